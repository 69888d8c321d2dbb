"""CLIP byte-level BPE tokenizer (a transcription of openai/CLIP's
simple_tokenizer.py) plus the builder of kiln-shapes' small vocabulary.

The files are in Hugging Face's CLIP format, so the same code reads CLIP-L's
real vocabulary:
    vocab.json   {"token": id}; ids: 256 byte symbols, the same 256 + "</w>",
                 one token per merge (in merge order), <|startoftext|>,
                 <|endoftext|>
    merges.txt   "#version: 0.2", then one merge "left right" per line, in
                 rank order (line 2 = rank 0)

Encoding (as CLIP): html-unescape, collapse whitespace, lower-case; split
with CLIP's regex; map each piece's UTF-8 bytes through bytes_to_unicode;
the last symbol gets "</w>"; repeatedly merge the adjacent pair with the
lowest rank (all its non-overlapping occurrences, left to right) until no
pair has a rank. Then [start] + ids[:75] + [end], padded with the end token
to 77 (SD 1.x's FrozenCLIPEmbedder pads with <|endoftext|>).

Only difference from CLIP: Python's `re` has no \\p{L} / \\p{N}, so letters
are [^\\W\\d_] and numbers \\d (the same for ASCII and nearly all text), and
ftfy.fix_text is not applied.
"""

import html
import json
import re
from collections import Counter

PAT = re.compile(r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[^\W\d_]+|\d|(?:[^\s\w]|_)+""",
                 re.IGNORECASE)
# CLIP: [\p{L}]+ | [\p{N}] | [^\s\p{L}\p{N}]+ ; '_' is not a letter or a
# number, so it belongs to the last class, as here.

SOT, EOT = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode():
    """CLIP's reversible byte -> printable unicode character map."""
    bs = (list(range(ord("!"), ord("~") + 1)) +
          list(range(ord("\u00a1"), ord("\u00ac") + 1)) +
          list(range(ord("\u00ae"), ord("\u00ff") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def get_pairs(word):
    return {(word[i], word[i + 1]) for i in range(len(word) - 1)}


def clean(text):
    text = html.unescape(html.unescape(text)).strip()
    return re.sub(r"\s+", " ", text).strip().lower()


class Tokenizer:
    def __init__(self, vocab_path, merges_path, context_length=77):
        with open(vocab_path, encoding="utf-8") as f:
            self.encoder = json.load(f)
        with open(merges_path, encoding="utf-8") as f:
            lines = f.read().strip().split("\n")
        assert lines[0].startswith("#version"), merges_path
        merges = [tuple(l.split()) for l in lines[1:]]
        self.bpe_ranks = {m: i for i, m in enumerate(merges)}
        self.byte_encoder = bytes_to_unicode()
        self.cache = {SOT: SOT, EOT: EOT}
        self.sot = self.encoder[SOT]
        self.eot = self.encoder[EOT]
        self.context_length = context_length

    def bpe(self, token):
        if token in self.cache:
            return self.cache[token]
        word = tuple(token[:-1]) + (token[-1] + "</w>",)
        pairs = get_pairs(word)
        if not pairs:
            return token + "</w>"
        while True:
            bigram = min(pairs, key=lambda p: self.bpe_ranks.get(p, float("inf")))
            if bigram not in self.bpe_ranks:
                break
            first, second = bigram
            new, i = [], 0
            while i < len(word):
                try:
                    j = word.index(first, i)
                except ValueError:
                    new.extend(word[i:])
                    break
                new.extend(word[i:j])
                i = j
                if word[i] == first and i < len(word) - 1 and word[i + 1] == second:
                    new.append(first + second)
                    i += 2
                else:
                    new.append(word[i])
                    i += 1
            word = tuple(new)
            if len(word) == 1:
                break
            pairs = get_pairs(word)
        out = " ".join(word)
        self.cache[token] = out
        return out

    def encode(self, text):
        """Token ids of text, without start/end tokens."""
        ids = []
        for tok in PAT.findall(clean(text)):
            tok = "".join(self.byte_encoder[b] for b in tok.encode("utf-8"))
            ids.extend(self.encoder[t] for t in self.bpe(tok).split(" "))
        return ids

    def __call__(self, text):
        """77 ids: start, up to 75 tokens, end, end-token padding."""
        ids = [self.sot] + self.encode(text)[:self.context_length - 2] + [self.eot]
        return ids + [self.eot] * (self.context_length - len(ids))


def build_vocab(words, vocab_path, merges_path):
    """Learn BPE merges (most frequent pair first, ties by first occurrence)
    until every word of `words` is one symbol; write CLIP-format files."""
    b2u = bytes_to_unicode()
    corpus = {}
    for w in words:
        syms = [b2u[b] for b in w.encode("utf-8")]
        syms[-1] += "</w>"
        corpus[w] = syms
    merges = []
    while True:
        counts = Counter()
        for syms in corpus.values():
            for p in zip(syms, syms[1:]):
                counts[p] += 1
        if not counts:
            break
        best = max(counts.items(), key=lambda kv: kv[1])[0]
        merges.append(best)
        for w, syms in corpus.items():
            out, i = [], 0
            while i < len(syms):
                if i < len(syms) - 1 and (syms[i], syms[i + 1]) == best:
                    out.append(syms[i] + syms[i + 1])
                    i += 2
                else:
                    out.append(syms[i])
                    i += 1
            corpus[w] = out
    base = list(b2u.values())
    vocab = base + [v + "</w>" for v in base]
    vocab += ["".join(m) for m in merges]
    vocab += [SOT, EOT]
    assert len(set(vocab)) == len(vocab)
    with open(vocab_path, "w", encoding="utf-8") as f:
        json.dump({t: i for i, t in enumerate(vocab)}, f, ensure_ascii=False)
    with open(merges_path, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write("%s %s\n" % (a, b))
    # every word must come out as a single token
    tok = Tokenizer(vocab_path, merges_path)
    for w in words:
        ids = tok.encode(w)
        assert len(ids) == 1, (w, ids)
    return len(vocab)
