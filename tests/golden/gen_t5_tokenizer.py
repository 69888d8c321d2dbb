#!/usr/bin/python3
"""Writes tests/golden/t5_tokenizer/corpus.txt: thousands of strings in many scripts
with the ids SentencePiece itself (Debian's python3-sentencepiece) gives them under T5
v1.1's model, plus </s> (1) as kiln.t5.tokenize returns them.

The model is built here as a SentencePiece ModelProto straight from the Hugging Face
tokenizer.json (pieces, scores, types, the normalizer spec with its precompiled
charsmap, add_dummy_prefix, remove_extra_whitespaces, escape_whitespaces; unk 2, eos 1,
pad 0, no bos), independently of kiln's compact copy, which is then checked to hold the
same pieces, scores and charsmap. Known ids from Hugging Face's own fixtures for
google-t5/t5-base cross-check the model first.

Format: one case a line, "HEX<TAB>id id id ... 1", HEX the input's bytes (so invalid
UTF-8, NUL, tabs and newlines survive). Cases: hand-picked ones, then random strings
from a fixed seed.

Rerun: /usr/bin/python3 tests/golden/gen_t5_tokenizer.py [tokenizer.json]
(from the repository root; needs python3-sentencepiece and python3-protobuf).
"""
import gzip
import os
import random
import sys

sys.path.insert(0, "runtime/data")
import gen_t5_vocab  # noqa: E402  (the tokenizer.json reader and the compact form's reader)

import sentencepiece as spm  # noqa: E402
from sentencepiece import sentencepiece_model_pb2 as pb  # noqa: E402

OUT = "tests/golden/t5_tokenizer/corpus.txt"


def build_processor(tj):
    pieces, charsmap = gen_t5_vocab.model_of(tj)
    vocab = tj["model"]["vocab"]
    m = pb.ModelProto()
    for i, (p, s, t) in enumerate(pieces):
        sp = m.pieces.add()
        sp.piece = vocab[i][0]
        sp.score = vocab[i][1]
        sp.type = {1: pb.ModelProto.SentencePiece.NORMAL, 2: pb.ModelProto.SentencePiece.UNKNOWN,
                   3: pb.ModelProto.SentencePiece.CONTROL}[t]
    ts = m.trainer_spec
    ts.model_type = pb.TrainerSpec.UNIGRAM
    ts.vocab_size = len(pieces)
    ts.unk_id, ts.eos_id, ts.pad_id, ts.bos_id = 2, 1, 0, -1
    ts.byte_fallback = False
    ns = m.normalizer_spec
    ns.name = "nmt_nfkc"  # T5's spiece.model; the charsmap below is what is applied
    ns.precompiled_charsmap = charsmap
    ns.add_dummy_prefix = True
    ns.remove_extra_whitespaces = True
    ns.escape_whitespaces = True
    proc = spm.SentencePieceProcessor(model_proto=m.SerializeToString())
    assert proc.GetPieceSize() == 32000 and proc.unk_id() == 2 and proc.eos_id() == 1
    return proc, pieces, charsmap


def check_compact_copy(pieces, charsmap):
    with open(gen_t5_vocab.OUT, "rb") as f:
        got_pieces, got_cm = gen_t5_vocab.unpack(gzip.decompress(f.read()))
    assert got_cm == charsmap, "runtime/data/t5_spiece.bin.gz: charsmap differs from tokenizer.json"
    assert len(got_pieces) == len(pieces)
    for (a, sa, ta), (b, sb, tb) in zip(got_pieces, pieces):
        # the compact copy holds f32 scores, as SentencePiece's proto does
        assert a == b and ta == tb and sa == gen_t5_vocab.struct.unpack("<f", gen_t5_vocab.struct.pack("<f", sb))[0]


# Hugging Face's tokenizer fixtures for google-t5/t5-base (its tokenizer.json is T5 v1.1's vocabulary).
KNOWN = [
    ("Hello world", [8774, 296, 1]),
    ("Hello\tworld\nagain", [8774, 296, 541, 1]),
]

HAND = [
    "", " ", "   ", "\t", "\n", "\r\n", " \t \n ", "a", " a", "a ", "  a  b  ", "a" + " " * 200 + "b",
    "hello world", "Hello World!", "HELLO WORLD", "hello, world.", "Don't stop", "e-mail: a.b@c.de",
    "0", "12345", "3.14159", "1,000,000", "2024-01-31", "#ff00aa", "100%", "$9.99", "½ ¼ ¾", "x² + y³",
    "café", "naïve", "résumé", "Ångström", "Straße", "Ærøskøbing", "ŁÓDŹ", "İstanbul", "ǅ ǈ ǋ",
    "e\u0301", "a\u0308\u0304", "n\u0303", "\u0301", "\u0301\u0301\u0301", "Z\u0351\u036b\u0343\u036a\u0302\u036b",
    "ﬁ", "ﬂow", "ﬃ", "ﬀ", "Ⅻ", "㎏", "㍻", "№", "™", "℃", "…", "‥", "ｈｅｌｌｏ", "ＡＢＣ１２３", "！？",
    "\u3000full\u3000width\u3000space", "ｶﾀｶﾅ", "ﾊﾟ", "\u00a0nbsp\u00a0", "\u2002en\u2003em\u2009thin",
    "zero\u200bwidth", "\u200b", "\u200c\u200d", "\ufeffbom", "soft\u00adhyphen", "\u2028\u2029",
    "😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "a😀b", "😀😀😀", "emoji 🎨 art",
    "日本語のテキスト", "東京タワー", "中文字符测试", "한국어 텍스트", "ひらがな カタカナ",
    "Привет, мир!", "Ёжик в тумане", "Ελληνικά", "مرحبا بالعالم", "שלום עולם", "नमस्ते दुनिया",
    "สวัสดีชาวโลก", "ქართული", "Հայերեն", "አማርኛ", "ᚠᛇᚻ", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "𝐀𝐁𝐂", "Ⓐⓑⓒ", "①②③",
    "\x00", "a\x00b", "\x01\x02\x03", "\x07bell", "\x1b[31mred\x1b[0m", "\x7f", "\x85", "\x9f",
    "tab\tseparated\tvalues", "line1\nline2\nline3", "a\r\nb",
    "(masterpiece:1.2), best quality, (ultra-detailed:1.1), 1girl, solo, [blurry]",
    "a photo of an astronaut riding a horse on mars, 8k, trending on artstation",
    "((red hair)), blue eyes, <lora:detail:0.5>, BREAK, landscape",
    "cinematic still of a cat, shallow depth of field, vignette, highly detailed, bokeh, 35mm",
    "A cat holding a sign that says hello world",
    "</s>", "<pad>", "<unk>", "<extra_id_0>", "▁", "▁▁", "▁a", "a▁b", "__init__", "snake_case_name",
    "http://example.com/path?q=1&r=2", "C:\\Windows\\System32", "{\"key\": [1, 2]}", "<b>bold</b>",
    "Pneumonoultramicroscopicsilicovolcanoconiosis", "supercalifragilisticexpialidocious" * 10,
    "x" * 1000, "ab" * 500, "日本" * 300, "😀" * 200, " " * 1000, "a " * 500, "\u0301" * 100,
    "�", "\ufffd\ufffd", "\U0010ffff", "\ue000private", "\U000e0041tag",
]

HAND_BYTES = [
    b"\xff", b"\xfe\xff", b"a\xffb", b"\xc3", b"\xc3(", b"abc\xc3", b"\xe2\x82", b"\xe2\x82(", b"\xf0\x9f\x98",
    b"\xf0\x9f\x98 x", b"\xc0\xaf", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80",
    b"\xf8\x88\x80\x80\x80", b"\x80", b"\x80\x80\x80", b"caf\xe9", b"\xa0\xa1", b" \xff ", b"\xff" * 50,
    b"ok \xef\xbf\xbd ok", b"\xef\xbb\xbf\xef\xbb\xbf",
]

# Random strings: characters drawn from blocks of many scripts, with spaces, controls
# and invalid bytes mixed in.
POOLS = [
    (0x20, 0x7e, 12),     # ASCII printable
    (0x61, 0x7a, 12),     # lower-case words
    (0xc0, 0x17f, 4),     # Latin-1 / Latin Extended-A
    (0x180, 0x24f, 1),    # Latin Extended-B
    (0x300, 0x36f, 2),    # combining marks
    (0x370, 0x3ff, 1),    # Greek
    (0x400, 0x4ff, 3),    # Cyrillic
    (0x590, 0x5ff, 1),    # Hebrew
    (0x600, 0x6ff, 2),    # Arabic
    (0x900, 0x97f, 2),    # Devanagari
    (0xe00, 0xe7f, 1),    # Thai
    (0x1100, 0x11ff, 1),  # Hangul Jamo
    (0x1e00, 0x1eff, 1),  # Latin Extended Additional
    (0x2000, 0x206f, 2),  # general punctuation (spaces, zero-width, bidi)
    (0x2070, 0x218f, 1),  # super/subscripts, letterlike, number forms
    (0x2190, 0x2bff, 1),  # arrows, maths, symbols
    (0x2460, 0x24ff, 1),  # enclosed alphanumerics
    (0x3000, 0x30ff, 2),  # CJK punctuation, kana
    (0x3200, 0x33ff, 1),  # enclosed CJK, squared units
    (0x4e00, 0x9fff, 4),  # CJK ideographs
    (0xac00, 0xd7a3, 2),  # Hangul syllables
    (0xf900, 0xfaff, 1),  # CJK compatibility ideographs
    (0xfb00, 0xfb4f, 1),  # ligatures, Hebrew presentation forms
    (0xfe30, 0xfe6f, 1),  # small / vertical forms
    (0xff00, 0xffef, 3),  # full-width and half-width forms
    (0x1d400, 0x1d7ff, 1),  # mathematical alphanumerics
    (0x1f300, 0x1faff, 3),  # emoji
    (0x1f3fb, 0x1f3ff, 1),  # skin tones
    (0x0, 0x1f, 1),       # C0 controls
    (0x80, 0x9f, 1),      # C1 controls
]
SPECIALS = [" ", " ", " ", "  ", "\t", "\n", "\u200d", "\ufe0f", "\u3000", "\u00a0", "▁"]


def random_case(rng):
    weights = [w for _, _, w in POOLS]
    n = rng.choice([1, 2, 3, 5, 8, 12, 20, 30, 40, 60])
    out = bytearray()
    for _ in range(n):
        r = rng.random()
        if r < 0.15:
            out += rng.choice(SPECIALS).encode()
        elif r < 0.17:
            out += bytes([rng.randrange(0x80, 0x100)])  # a stray byte: invalid UTF-8
        else:
            lo, hi, _ = rng.choices(POOLS, weights)[0]
            c = rng.randint(lo, hi)
            if 0xd800 <= c < 0xe000:
                c = 0x20
            out += chr(c).encode()
    return bytes(out)


def word_case(rng, proc):
    """Concatenated vocabulary pieces and their neighbours: Viterbi's ties and choices."""
    ids = [rng.randrange(3, 32000) for _ in range(rng.randint(1, 8))]
    s = "".join(proc.IdToPiece(i) for i in ids).replace("▁", " " if rng.random() < 0.8 else "▁")
    return s.encode()


def run_cases():
    """Runs of one character or piece: paths that tie in exact arithmetic, decided by the
    order of SentencePiece's float additions."""
    out = []
    for ch in "!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~0123456789aeoxz" + "′″‴…・ー～。、日の😀ｗ":
        for n in (2, 3, 4, 5, 7, 8, 11, 16):
            out.append(ch * n)
    for w in ("ab", "la", "na", "ha", "ing", "▁a", "--=", "..,", "1.", "(("):
        for n in (2, 3, 6, 9):
            out.append(w * n)
    return out


def main():
    tj = gen_t5_vocab.read_tokenizer_json(sys.argv[1] if len(sys.argv) > 1 else None)
    proc, pieces, charsmap = build_processor(tj)
    check_compact_copy(pieces, charsmap)
    for text, ids in KNOWN:
        got = proc.EncodeAsIds(text) + [1]
        assert got == ids, (text, got, ids)
    rng = random.Random(38)
    cases = [t.encode() for t in HAND + run_cases()] + HAND_BYTES
    cases += [random_case(rng) for _ in range(3000)]
    cases += [word_case(rng, proc) for _ in range(1000)]
    seen, lines = set(), []
    for c in cases:
        if c in seen:
            continue
        seen.add(c)
        ids = proc.EncodeAsIds(c) + [1]
        lines.append(c.hex() + "\t" + " ".join(map(str, ids)))
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{OUT}: {len(lines)} cases")


if __name__ == "__main__":
    main()
