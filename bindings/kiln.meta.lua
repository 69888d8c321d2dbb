---@meta kiln
-- bindings/kiln.meta.lua - definitions of the whole kiln Lua API for
-- lua-language-server (LuaLS): completion, signatures and type checks in editors.
-- Installed as PREFIX/share/kiln/kiln.meta.lua; point LuaLS at it with
--   "workspace.library": ["/usr/local/share/kiln"]   (.luarc.json)
-- tests/lua/test_meta.lua checks that every function the live module exports is
-- declared here: module functions as `function kiln.NAME(` / `function kiln.SUB.NAME(`,
-- methods as `function Class:NAME(` under `---@class kiln.Class` + `local Class = {}`.
-- Dimensions count from 1; negative dimensions count from the end (-1 is the last).

---@alias kiln.DType "f32"|"f16"|"bf16"|"i32"|"i64"|"u8"|"f8_e4m3fn"|"f8_e5m2"|"q8_0"|"q4_0"|"q4_1"|"q5_0"|"q5_1"|"q4_k"|"q5_k"|"q6_k"
---@alias kiln.DeviceName "cpu"|"sim"|"cuda"|"cuda:0"|"cuda:1"|string
---@alias kiln.Shape integer[]
---@alias kiln.MemoryMode "high"|"normal"|"low"|"none"|"cpu"
---@alias kiln.Residency "mapped"|"host"|"device"

---@class kiln.TensorOptions
---@field dtype? kiln.DType
---@field device? kiln.DeviceName

---@class kiln.RandomOptions: kiln.TensorOptions
---@field seed? integer the same values as torch.manual_seed(seed); torch.randn(shape)

---The kiln runtime: tensors, ops, devices and memory, models, samplers, pipelines.
---Script modules (kiln.sample, kiln.pipeline, ...) load on first use.
---@class kiln
---@field version string "0.1.0"
---@field nn kiln.nn
---@field mem kiln.mem
---@field trace kiln.trace
---@field tile kiln.tile
---@field sample kiln.sample
---@field pipeline kiln.pipeline
---@field comfy kiln.comfy
---@field util kiln.util
---@field cli kiln.cli
---@field json kiln.json
---@field fault kiln.fault
---@field queue kiln.queue
---@field image kiln.image
kiln = {}

-- ---------------------------------------------------------------- tensors

---A tensor from a nested table of numbers (or a number: a 0-d tensor), on the default device.
---@param data number|table
---@param dtype? kiln.DType default "f32"
---@return kiln.Tensor
function kiln.tensor(data, dtype) end

---A tensor of zeros.
---@param shape kiln.Shape
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
function kiln.zeros(shape, opts) end

---A tensor of ones.
---@param shape kiln.Shape
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
function kiln.ones(shape, opts) end

---A tensor filled with value.
---@param shape kiln.Shape
---@param value number
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
function kiln.full(shape, value, opts) end

---A tensor whose contents are undefined.
---@param shape kiln.Shape
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
function kiln.empty(shape, opts) end

---Normal noise, N(0, 1); with opts.seed the same f32 values as PyTorch's CPU generator.
---@param shape kiln.Shape
---@param opts? kiln.DType|kiln.RandomOptions
---@return kiln.Tensor
function kiln.randn(shape, opts) end

---Uniform noise in [0, 1).
---@param shape kiln.Shape
---@param opts? kiln.DType|kiln.RandomOptions
---@return kiln.Tensor
function kiln.rand(shape, opts) end

---Seeds the generator randn/rand use when no seed is given.
---@param seed integer
function kiln.manual_seed(seed) end

---arange(n): 0 .. n-1; arange(a, b [, step]): a, a+step, ... below b. Integers give i64.
---@param a number
---@param b? number
---@param step? number
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
---@overload fun(n: number, opts?: kiln.DType|kiln.TensorOptions): kiln.Tensor
function kiln.arange(a, b, step, opts) end

---n values evenly spaced from a to b (both included).
---@param a number
---@param b number
---@param n integer
---@param opts? kiln.DType|kiln.TensorOptions
---@return kiln.Tensor
function kiln.linspace(a, b, n, opts) end

---Concatenates tensors along dim (default 1).
---@param list kiln.Tensor[]
---@param dim? integer
---@return kiln.Tensor
function kiln.cat(list, dim) end

---a + b (tensors or numbers, broadcasting).
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.add(a, b) end

---a - b
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.sub(a, b) end

---a * b (elementwise)
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.mul(a, b) end

---a / b
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.div(a, b) end

---a ^ b
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.pow(a, b) end

---Elementwise minimum.
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.minimum(a, b) end

---Elementwise maximum.
---@param a kiln.Tensor|number
---@param b kiln.Tensor|number
---@return kiln.Tensor
function kiln.maximum(a, b) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.exp(x) end

---Natural logarithm.
---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.log(x) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.sqrt(x) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.abs(x) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.tanh(x) end

---Clamps to [lo, hi] (nil: no bound on that side).
---@param x kiln.Tensor
---@param lo? number
---@param hi? number
---@return kiln.Tensor
function kiln.clamp(x, lo, hi) end

---Matrix product (batched over leading dimensions).
---@param a kiln.Tensor
---@param b kiln.Tensor
---@return kiln.Tensor
function kiln.matmul(a, b) end

-- ---------------------------------------------------------------- files

---Tensors of a .safetensors file (mapped, zero-copy on the cpu) and its metadata.
---@param path string
---@return table<string, kiln.Tensor> tensors
---@return table<string, string> metadata
function kiln.load_safetensors(path) end

---Writes tensors (and string metadata) as a .safetensors file.
---@param path string
---@param tensors table<string, kiln.Tensor>
---@param metadata? table<string, string>
function kiln.save_safetensors(path, tensors, metadata) end

---Maps a GGUF file (v2/v3): name -> tensor (shapes in PyTorch order; dtypes f32, f16,
---bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k) and its metadata as strings.
---@param path string
---@return table<string, kiln.Tensor> tensors
---@return table<string, string> metadata
function kiln.load_gguf(path) end

---Writes tensors as GGUF v3; with `type`, every tensor whose last dimension holds whole
---blocks is quantized by ggml's reference quantizer, the others keep f32/f16/bf16.
---@param path string
---@param tensors table<string, kiln.Tensor>
---@param opts? {type?: string, metadata?: table<string, string>}
function kiln.save_gguf(path, tensors, opts) end

---Reads a PNG as an f32 tensor [1, C, H, W] in [0, 1].
---@param path string
---@return kiln.Tensor
function kiln.load_png(path) end

---Writes an image tensor [1, C, H, W] or [C, H, W] (C = 1..4, values clamped to [0, 1])
---as an 8-bit PNG, atomically; opts.text adds text chunks.
---@param image kiln.Tensor
---@param path string
---@param opts? {text?: table<string, string|number>}
---@return string path
function kiln.save_png(image, path, opts) end

---The bytes kiln.save_png would write for the same arguments, made in memory (no file).
---@param image kiln.Tensor
---@param opts? {text?: table<string, string|number>}
---@return string png
function kiln.encode_png(image, opts) end

---The SHA-256 of a file as 64 hex digits (A1111's "Model hash" is the first 10).
---@param path string
---@return string
function kiln.sha256_file(path) end

-- ---------------------------------------------------------------- devices, threads, runtime

---Names of the devices present: {"cpu", "sim", "cuda:0", ...}.
---@return kiln.DeviceName[]
function kiln.devices() end

---Sets the device new tensors are made on.
---@param device kiln.DeviceName
function kiln.set_default_device(device) end

---@return kiln.DeviceName
function kiln.default_device() end

---Sets the number of CPU threads (0: one per core, or KILN_THREADS).
---@param n integer
function kiln.set_threads(n) end

---@return integer
function kiln.threads() end

---The arithmetic of the networks: "f32", "bf16" (on the CPU: products with bf16 inputs
---and f32 sums, AVX-512 needed) or "f16" (on the CPU: f16 weights, f32 arithmetic), for
---every device; "auto" gives each device its own default back (the CPU's is f32).
---Returns the precision of the default device before the call (no argument: the current one).
---@param name? "f32"|"bf16"|"f16"|"auto"
---@return "f32"|"bf16"|"f16"
function kiln.precision(name) end

---The precision the networks on a device compute in: the one set, else the device's default.
---@param device? kiln.DeviceName default: the default device
---@return "f32"|"bf16"|"f16"
function kiln.precision_of(device) end

---The dtype the networks keep their activations in on a device under the precision in
---effect there (kiln.precision): "f16" / "bf16" on a GPU under a half precision, else
---"f32" (the CPU rounds inside its kernels instead). Networks convert their input to it
---and their output back to f32.
---@param device? kiln.DeviceName default: the default device
---@return "f32"|"f16"|"bf16"
function kiln.activation_dtype(device) end

---Runs fn(...) with the precision scoped to the calling thread (and the CPU pool's
---workers for its ops): name wins over kiln.precision there, other threads and the
---process-wide setting keep theirs; "auto" or nil: no override. kiln.precision() and
---kiln.precision_of() inside fn report the scoped one. The scope ends when fn returns
---or raises (the error goes on unchanged); fn may not yield.
---@param name "f32"|"bf16"|"f16"|"auto"|nil
---@param fn fun(...): ...
---@return ... fn's results
function kiln.with_precision(name, fn, ...) end

---True when the CPU computes bf16 products natively (AVX-512 BF16's vdpbf16ps), where
---a bf16 precision makes the CPU kernels' products cheaper.
---@return boolean
function kiln.cpu_has_bf16() end

---Sets (and returns) the memory mode: "high" keeps weights on the device, "normal" evicts
---least recently used models when the budget requires, "low" streams weights layer by
---layer, "none"/"cpu" runs on the CPU.
---@param mode? kiln.MemoryMode
---@return kiln.MemoryMode
function kiln.memory_mode(mode) end

---Seconds on a monotonic clock.
---@return number
function kiln.time() end

---Whether a standard stream is a terminal.
---@param stream? "stdin"|"stdout"|"stderr" default "stderr"
---@return boolean
function kiln.isatty(stream) end

---Turns progress bars and chatter off (the kiln program's --quiet).
---@param on boolean
function kiln.set_quiet(on) end

---@return boolean
function kiln.quiet() end

---@class kiln.Config
---@field device? kiln.DeviceName the default device
---@field mode? kiln.MemoryMode|"auto" "auto" leaves the mode to each run's planner
---@field budget? integer|string bytes, or a size such as "6G", of `device` (else the default device)
---@field threads? integer CPU threads (0: one per core)
---@field quiet? boolean
---@field trace? string|false a trace file to write; false stops a running trace
---@field precision? "f32"|"bf16"|"f16"|"auto" arithmetic of the networks ("auto": each device's own)

---The one settings route of a runtime (the kiln program's options, kiln.h contexts and
---scripts go through it). Absent fields are left as they are; a bad field raises a
---usage error ({kind = "usage", field =, detail =, message = "field: detail"}).
---@param config kiln.Config
function kiln.configure(config) end

---"6G", "512M", "1.5GiB", "100000" -> bytes (binary units: K = 1024).
---@param s string
---@return integer
function kiln.parse_size(s) end

---Bytes as people read them: "512 B", "1.5 KiB", "12.0 MiB", "1.50 GiB".
---@param n number
---@return string
function kiln.format_bytes(n) end

---Fault injection for tests: the n-th allocation (any device) or atomic-file write
---from now fails as if memory or disk ran out.
---@class kiln.fault
kiln.fault = {}

---@param kind "alloc"|"write"
---@param n? integer the failing event's number from now (0 or nil: off)
function kiln.fault.arm(kind, n) end

---@param kind "alloc"|"write"
---@return integer events since the last arm
function kiln.fault.count(kind) end

---JSON (RFC 8259) through the runtime's strict reader.
---@class kiln.json
---@field null lightuserdata what JSON's null decodes to
kiln.json = {}

---Objects become tables, arrays lists, null kiln.json.null; malformed text raises.
---@param text string
---@return any
function kiln.json.decode(text) end

---Compact JSON text of a Lua value (tables with keys 1..n are arrays).
---@param value any
---@return string
function kiln.json.encode(value) end

---The Redis client under `kiln batch` (hiredis): stream commands, reconnect with backoff.
---@class kiln.queue
kiln.queue = {}

---True when kiln was built with hiredis (else connect raises what to install).
---@return boolean
function kiln.queue.available() end

---Connects; opts in milliseconds: connect_timeout, timeout (I/O), retry (how long a
---command keeps reconnecting; -1 none).
---@param host string
---@param port integer
---@param opts? {connect_timeout?: integer, timeout?: integer, retry?: integer}
---@return kiln.Queue
function kiln.queue.connect(host, port, opts) end

---A connection to Redis; replies as Lua values (arrays as lists, nil as false).
---@class kiln.Queue
local Queue = {}

---Any command; a server error raises "queue: <message>".
---@param ... string|number
---@return any
function Queue:command(...) end

---XADD stream * k1 v1 ...; returns the entry id.
---@param stream string
---@param fields (string|number)[]
---@return string
function Queue:xadd(stream, fields) end

---XREADGROUP; entries {stream, id, fields}.
---@param group string
---@param consumer string
---@param streams string[]
---@param opts? {count?: integer, block?: integer, id?: string}
---@return table[]
function Queue:xreadgroup(group, consumer, streams, opts) end

---XACK; the number acknowledged.
---@param stream string
---@param group string
---@param ... string ids
---@return integer
function Queue:xack(stream, group, ...) end

---XAUTOCLAIM (XPENDING + XCLAIM before Redis 6.2); entries now the consumer's, next cursor.
---@param stream string
---@param group string
---@param consumer string
---@param min_idle_ms integer
---@param opts? {start?: string, count?: integer}
---@return table[], string
function Queue:xautoclaim(stream, group, consumer, min_idle_ms, opts) end

---XPENDING: the summary {count, consumers = {name = n}}, or with opts the rows
---{id, consumer, idle, deliveries}.
---@param stream string
---@param group string
---@param opts? {start?: string, stop?: string, count?: integer, consumer?: string}
---@return table
function Queue:xpending(stream, group, opts) end

---{server_version, reconnects}.
---@return table
function Queue:info() end

---Closes the connection (also __close and __gc).
function Queue:close() end

---Bytes as people read them, in binary units with three significant digits:
---"512 B", "1.50 KiB", "12.0 MiB", "2.00 TiB" (the memory summary's form).
---@param n number
---@return string
function kiln.format_bytes(n) end

-- ---------------------------------------------------------------- progress, cancel

---Reports step `step` of `total` (0: unknown) to the kiln.on_progress handler and to an
---embedding host, then raises the "cancelled" error ({kind = "cancelled", message}) when a
---cancel was requested. Loops (samplers, tiles) call it between steps.
---@param step integer
---@param total? integer
---@param message? string what is running ("sample", "decode tiles")
function kiln.progress(step, total, message) end

---Sets the handler kiln.progress calls (nil: none); returns the previous one.
---@param fn? fun(step: integer, total: integer, message: string)
---@return fun(step: integer, total: integer, message: string)|nil
function kiln.on_progress(fn) end

---Requests (or with false withdraws) a cancel: the next kiln.progress raises "cancelled".
---@param on? boolean default true
function kiln.cancel(on) end

---Whether a cancel was requested (by kiln.cancel or the embedding host's kiln_cancel).
---@return boolean
function kiln.cancelled() end

---Where a run may park for its embedding host (kiln_suspend: every device byte moves to
---host memory until kiln_resume; "cancelled" is raised when kiln_cancel came meanwhile)
---and where a budget lowered live takes effect (evict, then stream the running networks,
---then enforce it). The pipelines call it between network blocks, sampler steps and tiles.
function kiln.suspend_point() end

---@class kiln.SuspendStats
---@field parks integer times parked (kiln_suspend) in this state
---@field bytes integer bytes moved to the host at the last park
---@field park_seconds number last park: kiln_suspend called to parked
---@field resume_seconds number last resume: kiln_resume called to running

---The embedding host's parks of this state (zeros without a host).
---@return kiln.SuspendStats
function kiln.suspend_stats() end

---How often the embedding host wants previews (kiln_set_preview's every), nil when it
---wants none (or there is no host). The pipelines ask it; a script's own loop may too.
---@return integer|nil
function kiln.preview_every() end

---Hands the first image of a batch [B, C, H, W] (values in [0, 1]) to the embedding
---host's preview callback as 8-bit pixels; nothing without one.
---@param step integer
---@param total integer
---@param image kiln.Tensor
function kiln.preview_image(step, total, image) end

-- ---------------------------------------------------------------- models

---A weight store over one or more .safetensors files: nothing is read until used.
---@param paths string|string[]
---owner "lora" accounts its memory to "lora:NAME" (a LoRA file's factors) instead of "model:NAME".
---@param paths string|string[]
---@param opts? {name?: string, prefix?: string|string[], owner?: "model"|"lora"}
---@return kiln.Model
function kiln.model(paths, opts) end

---Loads a Stable Diffusion checkpoint (a .safetensors file or a diffusers folder) as
---{clip, unet, vae, family}; nothing is read yet.
---loras / embeddings name the folders ckpt:find_lora and prompts' embedding:NAME look in.
---@param path string
---vae: a VAE file, or "taesd" (found beside the checkpoint, see kiln.taesd), a TAESD file or a kiln.load_taesd object.
---@param opts? {tokenizer?: string, vae?: string|kiln.TAESD, clip?: string, loras?: string, embeddings?: string}
---@return kiln.Checkpoint
function kiln.load_checkpoint(path, opts) end

---The names of the model families kiln runs, in detection order ("sd1", "sd2", "sdxl", "flux");
---ckpt.family is one of them. Each is a module under kiln.families.*, listed by the
---registry require("kiln.family") (register(def) adds one at run time).
---@type string[]
kiln.families = {}

---@class kiln.ControlNet: kiln.Model
---@field config table hyper-parameters read from the shapes (unet.config's, plus hint_channels)
---@field tileable? "x"|"y"|"xy" circular padding as the UNet's (the pipelines set it for tileable runs)
local ControlNet = {}

---Runs the ControlNet: the residuals to add to the UNet (one per input block, then the
---middle block), as unet:forward(x, t, context, y, {control = residuals}) takes them.
---hint [B or 1, 3, 8h, 8w] in [0, 1]; opts.strength scales every residual (default 1).
---@param x kiln.Tensor
---@param t kiln.Tensor|number|number[]
---@param context kiln.Tensor
---@param hint kiln.Tensor
---@param y? kiln.Tensor
---@param opts? {strength?: number}
---@return kiln.Tensor[]
function ControlNet:forward(x, t, context, hint, y, opts) end

---Loads a ControlNet (.safetensors: the original layout with or without control_model.,
---or the diffusers layout) as a model like the checkpoint's parts; nothing is read yet.
---@param path string
---@return kiln.ControlNet
function kiln.load_controlnet(path) end

-- ---------------------------------------------------------------- upscale models

---An image upscale model (ESRGAN / Real-ESRGAN RRDBNet in either key layout, Real-ESRGAN
---compact SRVGGNetCompact); a model like the checkpoint's parts.
---@class kiln.Upscaler: kiln.Model
---@field scale integer 1, 2, 4 or 8
---@field arch string "RRDBNet" or "SRVGGNetCompact"
---@field config table hyper-parameters read from the shapes (nf, gc, nb, unshuffle, ...)
---@field tileable? "x"|"y"|"xy" circular padding and wrapped tiles by default (upscale's option)
local Upscaler = {}

---img [B, C, H, W] in [0, 1] (C 3; 4: RGBA, the alpha upscaled bilinearly apart; 1: grey,
---returned as RGB) -> [B, 3 or 4, sH, sW] in [0, 1] on img's device. Tiled (tile and
---overlap in input pixels; default tile from the free budget; false: untiled), an
---out-of-memory error retried with the tile halved, seams blended. tileable: a picture that
---tiles (circular padding on those axes, tiles that wrap around).
---@param img kiln.Tensor
---@param opts? {tile?: integer|"auto"|false, overlap?: integer, min_tile?: integer, tileable?: "x"|"y"|"xy"}
---@return kiln.Tensor
function Upscaler:upscale(img, opts) end

---The bare network (untiled, unclamped) on x [B, 3, H, W].
---@param x kiln.Tensor
---@return kiln.Tensor
function Upscaler:forward(x) end

---Loads an upscale model (.safetensors); the architecture and every hyper-parameter come
---from the tensors' names and shapes; other architectures (SwinIR, HAT, DAT, ...) are
---named in the error.
---@param path string
---@return kiln.Upscaler
function kiln.load_upscaler(path) end

---Google's T5 v1.1 text encoder (Flux, SD 3.5, PixArt), also its weight store: load,
---offload, unload, bytes, {resident = bytes}; mode "low" streams it block by block.
---Computes in f32 or bf16 (kiln.precision; under "f16" in f32 on the CPU, bf16 elsewhere).
---@class kiln.T5: kiln.Model
---@field config table d_model, heads, d_kv, inner, d_ff, vocab, blocks, buckets, layout, dtype
local T5 = {}

---Token ids (an integer tensor [B, n] or [n], or Lua lists) -> the last hidden state
---[B, n, d_model] f32, as transformers' T5EncoderModel(ids).last_hidden_state (no mask).
---An id outside the vocabulary is an error.
---@param ids kiln.Tensor|integer[]|integer[][]
---@return kiln.Tensor
function T5:forward(ids) end

---A prompt's final hidden states [1, n, d_model] f32; opts.length pads (with 0) or cuts
---(closing with </s>) its ids to that many. Cached per encoder: the same ids on the same
---device in the same precision are encoded once, and a hit returns a view of the cached
---tensor, the caller's to free and never to write into (:clone() for a private copy).
---opts.cache = false encodes without looking. The memory budget evicts the cache.
---@param text string
---@param opts? {length?: integer, cache?: boolean}
---@return kiln.Tensor
function T5:encode(text, opts) end

---Drops the cached encodings (a view a caller holds stays valid).
function T5:clear_cache() end

---Loads a T5 v1.1 encoder: ComfyUI's t5xxl_fp16 / t5xxl_fp8_e4m3fn(_scaled) .safetensors
---(transformers' names under any prefix), a GGUF file in llama.cpp's names (q8_0, K-quants,
---...), or a diffusers folder (text_encoder_2/ itself, or the pipeline folder). The
---hyper-parameters come from the shapes (heads from the relative attention bias table;
---opts.heads, a num_heads in the file or its config.json must agree).
---opts.cache: the bytes t5:encode's cache may hold (or a size like "64M"; default 64 MiB,
---0 turns it off).
---@param path string
---@param opts? {heads?: integer, cache?: integer|string}
---@return kiln.T5
function kiln.load_t5(path, opts) end

-- ---------------------------------------------------------------- TAESD, previews

---TAESD / TAESDXL, the tiny autoencoder; a model like the checkpoint's parts (both halves).
---@class kiln.TAESD: kiln.Model
---@field latent_channels integer 4 for SD 1.x/2.x/XL
---@field width integer channels of the stack (64 as published)
---@field tileable? "x"|"y"|"xy" circular padding and wrapped tiles (the pipelines set it for tileable runs)
local TAESD = {}

---Latents as samplers produce them (the same scaled latents as vae:decode) -> images
---[B, 3, 8h, 8w] clamped to [0, 1]. opts: {tile = T | "auto", overlap = O} in latent units.
---@param z kiln.Tensor
---@param opts? {tile?: integer|"auto", overlap?: integer}
---@return kiln.Tensor
function TAESD:decode(z, opts) end

---Images [B, 3, H, W] in [0, 1] -> scaled latents [B, 4, H/8, W/8] (as vae:encode).
---@param img kiln.Tensor
---@param opts? {tile?: integer|"auto", overlap?: integer}
---@return kiln.Tensor
function TAESD:encode(img, opts) end

---Loads TAESD from taesd_decoder.safetensors / taesd_encoder.safetensors (taesdxl_* for
---SDXL; either may be missing, not both; a string is a decoder path); nothing is read yet.
---@param files string|{decoder?: string, encoder?: string}
---@return kiln.TAESD
function kiln.load_taesd(files) end

---Previews of a sampling in progress.
---@class kiln.preview
kiln.preview = {}

---Latents [B, 4, h, w] (scaled, as samplers produce them) -> RGB [B, 3, h*scale, w*scale]
---in [0, 1] through the family's linear latent->RGB factors (ComfyUI's Latent2RGB).
---@param z kiln.Tensor
---@param family "sd1"|"sd2"|"sdxl"
---@param opts? {scale?: integer}
---@return kiln.Tensor
function kiln.preview.latent2rgb(z, family, opts) end

-- ---------------------------------------------------------------- LoRA

---@class kiln.LoraInfo
---@field format string "kohya", "peft", "diffusers", "lycoris-loha", "lycoris-lokr", "lycoris-full" (joined with "+" when mixed; "+dora" with DoRA scales)
---@field family? "sd1"|"sd2"|"sdxl" nil when the shapes do not say (non-standard widths)
---@field family_reason? string the shapes that told the family
---@field parts {unet: integer, clip: integer} adapted modules per part
---@field keys integer tensors in the file
---@field modules integer adapted modules
---@field few_step? kiln.FewStepKind what few-step LoRA the file says it is (LCM, TCD, Hyper-SD, Lightning)

---A few-step model's kind as its file says it (kiln.few_step_kind): the sampling the
---pipelines take as defaults under the caller's options.
---@class kiln.FewStepKind
---@field name "lcm"|"tcd"|"hyper"|"lightning"|"turbo"
---@field label string
---@field defaults {sampler?: string, scheduler?: string, steps?: integer, cfg?: number}
---@field evidence string what told it ("__metadata__ modelspec.title ...", "the file name ...")

kiln.lora = {}

---What a LoRA file is, without a checkpoint (format, family, parts); raises when the
---file is not a LoRA, saying what it looks like.
---@param path string
---@return kiln.LoraInfo
function kiln.lora.inspect(path) end

---ckpt:add_lora(path, opts) as a function.
---@param ckpt kiln.Checkpoint
---@param path string
---@param opts? {unet?: number, clip?: number, name?: string}
---@return kiln.Lora
function kiln.lora.add(ckpt, path, opts) end

---ckpt:find_lora(name) as a function.
---@param ckpt kiln.Checkpoint
---@param name string
---@return string
function kiln.lora.find(ckpt, name) end

-- ---------------------------------------------------------------- kiln.image

---@class kiln.image
kiln.image = {}

---Canny edges as ComfyUI's Canny node computes them (kornia.filters.canny: grey,
---Gaussian blur 5/1, Sobel, non-maximum suppression, double threshold, hysteresis).
---@param img kiln.Tensor [N, 1|3, H, W] f32 in [0, 1]
---@param low number threshold on the gradient magnitude, in [0, 1] (ComfyUI's default 0.4)
---@param high number in [low, 1] (ComfyUI's default 0.8)
---@return kiln.Tensor edges [N, 3, H, W]: 1 on edges, 0 elsewhere
function kiln.image.canny(img, low, high) end

---An image resized as ComfyUI's common_upscale does: with crop = "center" first cut to
---the target's aspect ratio about the centre, then interpolated (ControlNet hints); area and
---bicubic as PyTorch's interpolate, lanczos as Pillow's on 8-bit RGB, bislerp as ComfyUI's.
---@param img kiln.Tensor [B, C, H, W]
---@param w integer
---@param h integer
---@param opts? {mode?: "nearest-exact"|"nearest"|"bilinear"|"area"|"bicubic"|"lanczos"|"bislerp", crop?: "center"|"disabled"}
---@return kiln.Tensor
function kiln.image.resize(img, w, h, opts) end

---CLIP's byte-level BPE tokenizer: a folder with vocab.json + merges.txt, a vocab.json,
---or CLIP's bpe_simple_vocab_16e6.txt.gz; no path: CLIP's vocabulary built into kiln.
---@param path? string
---@return kiln.Tokenizer
function kiln.tokenizer(path) end

---T5 v1.1's tokenizer (Flux, SD 3.5, PixArt ... condition on T5): SentencePiece's
---Unigram model with T5's own vocabulary, built into kiln (runtime/data/LICENSE-T5).
---@class kiln.t5
kiln.t5 = {}

---T5 v1.1 token ids of text, exactly as SentencePiece gives them, ending in 1 (</s>),
---no padding; any bytes (malformed UTF-8 reads as U+FFFD, as in SentencePiece).
---@param text string
---@return integer[]
function kiln.t5.tokenize(text) end

-- ---------------------------------------------------------------- kiln.nn

---Functional neural-network ops, as PyTorch's torch.nn.functional.
---@class kiln.nn
kiln.nn = {}

---x @ w^T + b
---@param x kiln.Tensor [..., in]
---@param w kiln.Tensor [out, in]
---@param b? kiln.Tensor [out]
---@return kiln.Tensor
function kiln.nn.linear(x, w, b) end

---2-d convolution; stride, padding and dilation are numbers or {h, w}.
---@param x kiln.Tensor [N, C, H, W]
---@param w kiln.Tensor [K, C/groups, kh, kw]
---@param b? kiln.Tensor [K]
---opts.upsample = 2 upsamples x 2x (nearest) first, as upsample_nearest(x, 2) would, fused with
---the convolution where it can be (3x3, stride 1, padding 1, on the CPU): the upsampled
---image (4x the input) is never made, and the decoders' Upsample blocks run faster (README: speed).
---opts.leaky_relu = slope applies a leaky ReLU to the output in place (no second tensor).
---opts.residual = r (a tensor of the output's shape) is added before the activation:
---act(conv(x) + b + r), a residual block's skip in the same op (no sum tensor).
---@param opts? {stride?: integer|integer[], padding?: integer|integer[], dilation?: integer|integer[], groups?: integer, upsample?: integer, leaky_relu?: number, residual?: kiln.Tensor}
---@return kiln.Tensor
function kiln.nn.conv2d(x, w, b, opts) end

---Group normalization (opts.silu fuses a SiLU after it). opts.inplace writes the result
---over x and returns x itself (x: contiguous f32, not a view of another tensor nor mapped
---from a file): one activation less when x is not needed afterwards.
---@param x kiln.Tensor
---@param groups integer
---@param w? kiln.Tensor
---@param b? kiln.Tensor
---@param eps? number default 1e-5
---@param opts? {silu?: boolean, inplace?: boolean}
---@return kiln.Tensor
function kiln.nn.group_norm(x, groups, w, b, eps, opts) end

---Layer normalization over the last dimension.
---@param x kiln.Tensor
---@param w? kiln.Tensor
---@param b? kiln.Tensor
---@param eps? number default 1e-5
---@return kiln.Tensor
function kiln.nn.layer_norm(x, w, b, eps) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.nn.silu(x) end

---GELU, exact or with the tanh approximation.
---@param x kiln.Tensor
---@param approximate? "none"|"tanh"|{approximate?: "none"|"tanh"}
---@return kiln.Tensor
function kiln.nn.gelu(x, approximate) end

---x * sigmoid(1.702 x) (CLIP's activation).
---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.nn.quick_gelu(x) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.nn.sigmoid(x) end

---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.nn.relu(x) end

---max(x, 0) + negative_slope * min(x, 0), as torch.nn.functional.leaky_relu.
---@param x kiln.Tensor
---@param negative_slope? number default 0.01
---@return kiln.Tensor
function kiln.nn.leaky_relu(x, negative_slope) end

---GEGLU: the last dimension split in halves a, b; returns a * gelu(b).
---@param x kiln.Tensor
---@return kiln.Tensor
function kiln.nn.geglu(x) end

---@param x kiln.Tensor
---@param dim integer
---@return kiln.Tensor
function kiln.nn.softmax(x, dim) end

---Scaled dot-product attention, softmax(q k^T * scale) v; scale defaults to 1/sqrt(D).
---@param q kiln.Tensor [B, heads, Lq, D]
---@param k kiln.Tensor [B, heads, Lk, D]
---@param v kiln.Tensor [B, heads, Lk, D]
---@param opts? {scale?: number, causal?: boolean}
---@return kiln.Tensor
function kiln.nn.attention(q, k, v, opts) end

---Nearest-neighbour upsampling of [N, C, H, W] by an integer factor.
---@param x kiln.Tensor
---@param factor? integer default 2
---@return kiln.Tensor
function kiln.nn.upsample_nearest(x, factor) end

---Resizes [N, C, H, W] to opts.size or by opts.scale_factor.
---@param x kiln.Tensor
---@param opts {size?: integer[], scale_factor?: number, mode?: "nearest"|"nearest-exact"|"bilinear"}
---@return kiln.Tensor
function kiln.nn.interpolate(x, opts) end

---Pads the last two dimensions by {left, right, top, bottom}; "circular" wraps around
---(the opposite edge's pixels), as F.pad's mode "circular".
---@param x kiln.Tensor
---@param pads integer[]
---@param mode? "constant"|"reflect"|"replicate"|"circular"
---@param value? number default 0
---@return kiln.Tensor
function kiln.nn.pad(x, pads, mode, value) end

-- ---------------------------------------------------------------- kiln.mem

---@class kiln.MemStats
---@field device string
---@field allocated integer bytes in live tensors and weights
---@field reserved integer bytes the device holds (allocated + cached free blocks)
---@field peak integer peak of allocated
---@field peak_allocated integer
---@field peak_reserved integer
---@field budget integer 0 = unlimited
---@field allocs integer
---@field frees integer
---@field ooms integer
---@field segments integer
---@field largest_free integer
---@field workspace integer kernel scratch held outside the allocator now (cpu: the host scratch of cpu and sim)
---@field workspace_peak integer the most of it in use at once since kiln.mem.reset_peak
---@field weight_caches integer bytes of the kernels' caches of weights held now (in allocated too)
---@field weight_cache_limit integer the most they may hold (kiln.mem.set_weight_cache_limit; -1: the budget alone)
---@field bytes_to_device integer
---@field bytes_to_host integer
---@field copied_in integer host -> device bytes since kiln.mem.reset_peak
---@field seconds_copying number

---@class kiln.MemEvent
---@field seq integer
---@field time number
---@field kind "load"|"offload"|"unload"|"evict"|"oom"|"alloc"|"free"|"mark"
---@field device string
---@field bytes integer
---@field owner string
---@field detail string
---@field thread integer

---Memory of each device: statistics, budgets, the summary table, the event log.
---@class kiln.mem
kiln.mem = {}

---@param device? kiln.DeviceName default: the default device
---@return kiln.MemStats
function kiln.mem.stats(device) end

---@param device? kiln.DeviceName
function kiln.mem.reset_peak(device) end

---Returns the device's cached free blocks to it, and the scratch its kernels keep between
---calls (CPU: Winograd / GEMM buffers, up to 4 x 64 MiB).
---@param device? kiln.DeviceName
function kiln.mem.empty_cache(device) end

---Sets a device's budget (0 = unlimited): allocations beyond it evict, then fail with
---an out-of-memory error {kind = "oom", device, requested, free, budget}. live: a change
---for a run in progress (as kiln_memory_set_budget from a host's thread): until its next
---kiln.suspend_point the block in flight may still use the old budget; there the run
---evicts, streams its networks, and the budget holds.
---@param device kiln.DeviceName
---@param bytes integer
---@param opts? {live: boolean}
function kiln.mem.set_budget(device, bytes, opts) end

---Limits the kernels' caches of weights on a device: the CPU's forms of the weights its
---products read (precision bf16's pair slivers and few-tiles Winograd transforms,
---int8's packed panels), named "(derived)" in kiln.mem.summary and counted in its
---statistics. They are taken only where they fit the budget without evicting and are
---the first memory given back when an allocation does not fit; without a budget this
---limit is what bounds them (the cpu's default: a quarter of physical memory). 0 takes
---none; -1 leaves only the budget. Caches over a lowered limit go at once.
---@param device kiln.DeviceName
---@param bytes integer
function kiln.mem.set_weight_cache_limit(device, bytes) end

---@class kiln.BudgetWatch
---@field changes integer budget changes of the device
---@field grace boolean a live lowering not yet applied (the old budget still holds)
---@field over boolean reserved > budget now
---@field lowered_at number the last lowering, seconds on the runtime's event clock (0: none)
---@field compliant_at number when reserved was first within it, no grace left (0: not yet)
---@field compliance_seconds? number compliant_at - lowered_at, nil until compliant
---@field peak_since integer most bytes reserved from compliant_at on
---@field peak_before integer most bytes reserved (since reset_peak) when it was lowered

---How the device's last budget lowering went.
---@param device? kiln.DeviceName
---@return kiln.BudgetWatch
function kiln.mem.budget_watch(device) end

---Evicts unpinned models' copies on the device, least recently used first, whatever
---the memory mode, until `bytes` are given back; returns the bytes given back.
---@param device kiln.DeviceName
---@param bytes integer
---@return integer
function kiln.mem.evict(device, bytes) end

---Starts a dry run by hand (kiln.dry_run does this around a function): the shape-only
---device meta models `device` under `budget` (0 or nil: none) and answers to its name.
---@param device kiln.DeviceName
---@param budget? integer|string bytes or a size such as "6G"
---@return string device the name meta answers to
function kiln.mem.meta_begin(device, budget) end

---Ends a dry run: models' copies made during it are dropped, meta is given back.
---@return integer bytes still allocated on meta by tensors that outlived the run
function kiln.mem.meta_end() end

---The device a running dry run models, or nil.
---@return string?
function kiln.mem.meta_target() end

---Peak allocated and reserved bytes on meta since the previous mark (or meta_begin).
---@return integer peak_allocated
---@return integer peak_reserved
function kiln.mem.meta_mark() end

---The kernel scratch outside the modelled device's allocator (the CPU's host scratch)
---predicted at its peak since meta_begin, bytes.
---@return integer
function kiln.mem.meta_scratch() end

---@class kiln.DryRunStage
---@field name string "encode", or nested "hires > decode"
---@field peak integer bytes allocated at the stage's peak
---@field peak_reserved integer

---@class kiln.DryRunReport
---@field device string the device modelled
---@field budget integer bytes (0: none)
---@field fits boolean
---@field oom? string the out-of-memory message, naming the stage
---@field peak integer same as peak_allocated
---@field peak_allocated integer
---@field peak_reserved integer
---@field stages kiln.DryRunStage[]
---@field seconds number
---@field leaked integer bytes left on meta after the run
---@field scratch integer the kernels' host scratch at its peak (cpu / sim; kiln.mem.stats("cpu").workspace_peak)

---@class kiln.DryRunOptions
---@field device? kiln.DeviceName the device to model (default: the default device)
---@field budget? integer|string bytes or "6G" (default: the device's budget)
---@field mode? "high"|"normal"|"low"|"none" memory mode during the run

---Runs fn on the shape-only device meta modelling a device: same allocator, budget and
---decisions, no arithmetic, no weight file read; returns the predicted peaks.
---@param fn fun(...)
---@param opts? kiln.DryRunOptions
---@return kiln.DryRunReport
function kiln.dry_run(fn, opts, ...) end

---A text table of every device and what holds its memory.
---@return string
function kiln.mem.summary() end

---What is alive in the process: tensor headers, the open models (by name) and the owners
---of the live storages ("OWNER on DEVICE (N storages, B bytes)"); the test runner's leak check.
---@return {tensors: integer, models: string[], storages: string[]}
function kiln.mem.live() end

---Whether prefetches copy at once on the calling thread (as a dry run's always do)
---instead of on the device's copy thread; sets it when `on` is given. Off by default:
---it takes the overlap of copies and compute away. Tests turn it on to compare a real
---run's peak with a dry run's without the copy thread's timing in it.
---@param on? boolean
---@return boolean
function kiln.mem.prefetch_at_once(on) end

---Tests: the copy thread waits `seconds` after each prefetch copy before installing it
---(a copy thread that gets no core); 0 turns it off. The copies' memory is taken when
---the prefetch is queued, so the peak does not depend on it.
---@param seconds number
function kiln.mem.copy_delay(seconds) end

---The memory events (loads, offloads, evictions, OOMs, ...) after seq `since`, oldest first.
---@param since? integer
---@return kiln.MemEvent[]
function kiln.mem.events(since) end

function kiln.mem.clear_events() end

---Allocations of at least `bytes` become "alloc"/"free" events (0 = off); returns the threshold.
---@param bytes? integer
---@return integer
function kiln.mem.event_threshold(bytes) end

---@class kiln.MemPlotOwner
---@field name string "model:unet", "lora:NAME", "tensor", "scratch", "workspace", ...
---@field color integer[] {r, g, b} in 0..255

---@class kiln.MemPlotLayout
---@field device string
---@field width integer
---@field height integer
---@field x0 integer the plot area is [x0, x1) x [y0, y1) in pixels from 0; y1 is 0 bytes
---@field x1 integer
---@field y0 integer
---@field y1 integer
---@field t0 number the time at x0 (the clock of kiln.mem.timeline)
---@field t1 number the time at x1
---@field ymax number bytes at y0
---@field owners kiln.MemPlotOwner[] bottom of the stack first
---@field budget_color integer[]

---@class kiln.MemTimelineFrame
---@field t0 number
---@field t1 number
---@field peak integer highest total within the frame
---@field budget integer
---@field at_peak table<string, integer> bytes by owner at the peak
---@field at_end table<string, integer> bytes by owner after the frame's last change

---@class kiln.MemStage
---@field name string
---@field t0 number
---@field t1? number nil while open
---@field depth integer
---@field thread integer
---@field failed boolean ended by an error
---@field peak integer the device's highest total while the stage was open
---@field peak_time number
---@field top_owner? string who held most at that moment
---@field top_bytes? integer

---@class kiln.MemTimeline
---@field device string
---@field start number
---@field stop number
---@field total integer bytes allocated now (the allocator's `allocated`)
---@field budget integer
---@field peak integer
---@field peak_time number
---@field owners string[]
---@field now table<string, integer> bytes by owner now
---@field frames kiln.MemTimelineFrame[]
---@field stages kiln.MemStage[]
---@field stages_dropped integer

---The memory picture: draws the device's bytes over time, stacked by owner, with the
---budget line and the stages (kiln.trace.span) into a PNG; returns the per-stage peak
---table (text) and where things were drawn. The device: opts.device, else the
---default device (or the device that recorded the most when that one recorded nothing).
---@param path string
---@param opts? {device?: kiln.DeviceName, width?: integer, height?: integer, title?: string}
---@return string table
---@return kiln.MemPlotLayout layout
function kiln.mem.plot(path, opts) end

---The per-stage peak table of kiln.mem.plot, without the picture.
---@param device? kiln.DeviceName
---@return string
function kiln.mem.stage_table(device) end

---The raw timeline: frames of bytes by owner and the stages with their peaks.
---@param device? kiln.DeviceName
---@return kiln.MemTimeline
function kiln.mem.timeline(device) end

---Forgets the frames and stages recorded so far (what is held now stays known).
function kiln.mem.clear_timeline() end

---Measures the peak bytes fn(inputs...) needs (run on a dry device), for sizing tiles
---and checking a budget before spending it; returns bytes and the details.
---@param fn function
---@param inputs any
---@param opts? table
---@return integer bytes
---@return table details
function kiln.mem.estimate(fn, inputs, opts) end

-- ---------------------------------------------------------------- kiln.tile

---@class kiln.TileOptions
---@field tile? integer largest tile side in the input's units (default 64); the tiles of an axis are shortened to what covers it with the overlap
---@field overlap? integer minimum overlap of neighbouring tiles (default tile/4)
---@field scale? number|string output size / input size: 8 (VAE decode), 0.125 or "1/8" (encode), 4, 1
---@field blend? string "linear" feathering of the overlaps
---@field multiple? integer tile sides rounded to a multiple of this
---@field gc? boolean collect garbage between tiles (default true)
---@field progress? string label: reports every tile through kiln.progress

---@class kiln.TilePlan
---@field count integer
---@field rows integer
---@field cols integer
---@field tile integer
---@field overlap integer
---@field out_h integer
---@field out_w integer

---Spatial tiling: peak memory depends on the tile, not the image.
---@class kiln.tile
kiln.tile = {}

---Runs fn over overlapping tiles of x (its last two dimensions) and blends the outputs,
---scaled by opts.scale, into one result. fn gets a contiguous copy of each tile and
---its 1-based index in kiln.tile.plan's list (tiles run in that order).
---@param x kiln.Tensor
---@param fn fun(tile: kiln.Tensor, index: integer): kiln.Tensor
---@param opts? kiln.TileOptions
---@return kiln.Tensor
function kiln.tile.map(x, fn, opts) end

---The grid kiln.tile.map would use: {count, rows, cols, ..., [i] = {input = {y, x, h, w},
---output = {y, x, h, w}}} with 1-based positions.
---@param height integer
---@param width integer
---@param opts? kiln.TileOptions
---@return kiln.TilePlan
function kiln.tile.plan(height, width, opts) end

-- ---------------------------------------------------------------- kiln.json

---JSON (RFC 8259) over the runtime's strict reader.
---@class kiln.json
kiln.json = {}

---The value JSON's null decodes to (a userdata that prints as "null"; encode writes
---it as null).
---@type userdata
kiln.json.null = nil

---Objects become tables, arrays lists (an empty one marked {__jsontype = "array"}),
---null kiln.json.null; integers within 64 bits stay integers. Malformed text raises
---an error that gives the byte offset; containers nest at most 64 deep.
---@param text string
---@return any
function kiln.json.decode(text) end

---Compact JSON: tables with keys 1..n are arrays, other tables objects with sorted keys
---(a metatable's __jsontype "array"/"object" decides for empty ones); nil and
---kiln.json.null are null. Cycles, NaN, infinities, invalid UTF-8 and functions raise.
---@param value any
---@return string
function kiln.json.encode(value) end

-- ---------------------------------------------------------------- kiln.trace

---Chrome trace files (Perfetto, chrome://tracing): memory events, counters and spans.
---@class kiln.trace
kiln.trace = {}

---@param path string
function kiln.trace.start(path) end

---Finishes the trace file; true when one was written, nil when no trace ran.
---@return true|nil
function kiln.trace.stop() end

---@return boolean
function kiln.trace.active() end

---Runs fn(...) inside a named span and returns its results (the span closes on error too).
---The span is also a stage of the memory picture (kiln.mem.plot), trace running or not.
---@generic R
---@param name string
---@param fn fun(...): R
---@param ... any
---@return R
function kiln.trace.span(name, fn, ...) end

---An instant event in the event log and the trace.
---@param name string
---@param detail? string
function kiln.trace.mark(name, detail) end

---Samples every device's memory counters into the trace now.
function kiln.trace.counters() end

-- ---------------------------------------------------------------- kiln.sample

---@alias kiln.Denoiser fun(x: kiln.Tensor, sigma: number): kiln.Tensor

-- The names of kiln.sample's registry; tests/lua/test_meta.lua keeps them equal to
-- kiln.sample.names() and kiln.sample.scheduler_names().
---@alias kiln.SamplerName "ddim"|"dpm_2"|"dpm_2_ancestral"|"dpmpp_2m"|"dpmpp_2m_sde"|"dpmpp_2s_ancestral"|"dpmpp_3m_sde"|"dpmpp_sde"|"euler"|"euler_ancestral"|"heun"|"lcm"|"lms"|"tcd"|"uni_pc"|"uni_pc_bh2"
---@alias kiln.SchedulerName "beta"|"ddim_uniform"|"exponential"|"karras"|"normal"|"sgm_uniform"|"simple"|"trailing"

---A sampler's registry entry.
---@class kiln.SamplerInfo
---@field name kiln.SamplerName
---@field fn function
---@field label string as A1111 writes it in a PNG's parameters ("DPM++ 2M", "Euler a")
---@field noise boolean whether it draws noise at every step (ancestral, SDE)

---A scheduler's registry entry.
---@class kiln.SchedulerInfo
---@field name kiln.SchedulerName
---@field fn function
---@field label string A1111's "Schedule type" ("Karras", "Exponential")
---@field needs_model boolean whether it reads opts.model_sampling

---@class kiln.SampleStep
---@field i integer
---@field n integer
---@field sigma number
---@field x kiln.Tensor
---@field denoised kiln.Tensor

---@class kiln.SampleOptions
---@field seed? integer
---@field noise? fun(shape: kiln.Shape, sigma?: number, sigma_next?: number): kiln.Tensor the noise ancestral and SDE samplers add (SDE samplers pass the two sigmas it bridges; default for them: sample.brownian_noise seeded by seed)
---@field callback? fun(step: kiln.SampleStep): boolean|nil return false to stop
---@field eta? number
---@field s_churn? number
---@field s_tmin? number
---@field s_tmax? number
---@field s_noise? number

---Samplers (k-diffusion's arithmetic, ComfyUI's names) and noise schedules.
---@class kiln.sample
---@field samplers table<string, function>
---@field schedules table<string, function>
kiln.sample = {}

---Runs a sampler of the registry (kiln.sample.names()) from x over sigmas; returns x.
---@param name kiln.SamplerName
---@param denoise kiln.Denoiser
---@param x kiln.Tensor
---@param sigmas kiln.Tensor|number[] ending in 0
---@param opts? kiln.SampleOptions
---@return kiln.Tensor
function kiln.sample.run(name, denoise, x, sigmas, opts) end

---steps + 1 sigmas ending in 0: "karras" / "exponential" (sigma_min, sigma_max, rho),
---"normal", "simple", "sgm_uniform", "ddim_uniform", "beta" (alpha, beta; default
---0.6, 0.6; fewer steps when timesteps repeat, as ComfyUI) (opts.model_sampling).
---@param name kiln.SchedulerName
---@param steps integer
---@param opts? {sigma_min?: number, sigma_max?: number, rho?: number, model_sampling?: table, alpha?: number, beta?: number}
---@return kiln.Tensor
function kiln.sample.sigmas(name, steps, opts) end

---The quantile function (inverse CDF) of the Beta(a, b) distribution.
---@param q number in [0, 1]
---@param a number
---@param b number
---@return number
function kiln.sample.beta_ppf(q, a, b) end

---The sampler names, sorted.
---@return kiln.SamplerName[]
function kiln.sample.names() end

---The scheduler names, sorted.
---@return kiln.SchedulerName[]
function kiln.sample.scheduler_names() end

---A sampler's registry entry (a copy), or nil for an unknown name.
---@param name string
---@return kiln.SamplerInfo|nil
function kiln.sample.sampler_info(name) end

---A scheduler's registry entry (a copy), or nil for an unknown name.
---@param name string
---@return kiln.SchedulerInfo|nil
function kiln.sample.scheduler_info(name) end

---Adds (or replaces) a sampler: the one place a sampler is registered.
---@param name string
---@param fn fun(denoise: kiln.Denoiser, x: kiln.Tensor, sigmas: number[], opts: table, noise: fun(shape: kiln.Shape, sigma?: number, sigma_next?: number): kiln.Tensor, step: function): kiln.Tensor
---@param label string A1111's name for it
---@param noise boolean|"brownian" whether it draws noise at every step; "brownian": an SDE sampler whose default noise is sample.brownian_noise
function kiln.sample.add_sampler(name, fn, label, noise) end

---ComfyUI's Brownian noise for the SDE samplers (k-diffusion's BrownianTreeNoiseSampler
---over torchsde's BrownianTree, same draws for the same seed):
---noise(shape, sigma, sigma_next) = (W(sigma_next) - W(sigma)) / sqrt(|sigma_next - sigma|).
---@param shape kiln.Shape
---@param sigmas kiln.Tensor|number[] the run's sigmas (the tree spans the smallest > 0 to the largest)
---@param seed integer
---@return fun(shape: kiln.Shape, sigma: number, sigma_next: number): kiln.Tensor
function kiln.sample.brownian_noise(shape, sigmas, seed) end

---torchsde's BrownianTree(t0, 0, t1, entropy = seed) (halfway tree, tol 1e-6, pool 24):
---returns increment(ta, tb) = W(tb) - W(ta) for t0 <= ta <= tb <= t1.
---@param shape kiln.Shape
---@param t0 number
---@param t1 number
---@param seed integer
---@return fun(ta: number, tb: number): kiln.Tensor
function kiln.sample.brownian_tree(shape, t0, t1, seed) end

---numpy.random.SeedSequence(entropy, spawn_key, pool_size).generate_state(n) as uint32 integers.
---@param entropy integer non-negative
---@param spawn_key? integer[]
---@param pool_size integer
---@param n integer
---@return integer[]
function kiln.sample.seed_sequence(entropy, spawn_key, pool_size, n) end

---Adds (or replaces) a scheduler: the one place a scheduler is registered.
---@param name string
---@param fn fun(steps: integer, opts: table): kiln.Tensor
---@param label string A1111's "Schedule type"
---@param needs_model boolean whether it reads opts.model_sampling
function kiln.sample.add_scheduler(name, fn, label, needs_model) end

---Stable Diffusion's discrete noise schedule (sigma <-> timestep).
---@param opts? table
---@return table
function kiln.sample.discrete_schedule(opts) end

---sigma_down, sigma_up of an ancestral step.
---@param sigma_from number
---@param sigma_to number
---@param eta? number
---@return number down
---@return number up
function kiln.sample.ancestral_step(sigma_from, sigma_to, eta) end

-- ---------------------------------------------------------------- kiln.pipeline

---@class kiln.PipelineOptions
---@field prompt? string
---@field negative? string
---@field seed? integer
---@field steps? integer
---@field cfg? number
---@field sampler? kiln.SamplerName
---@field scheduler? kiln.SchedulerName
---@field width? integer
---@field height? integer
---@field denoise? number
---@field device? kiln.DeviceName
---@field tile? integer|"auto"
---@field batch? integer images per run (noise randn([batch, 4, h, w]) from the one seed)
---@field clip_skip? integer text encoder layer from the end: 1 the last, 2 the penultimate (nil: the family's)
---@field weighting? "a1111"|"comfy" how prompt weights apply (clip:encode; nil: "a1111")
---@field control? kiln.ControlEntry[] ControlNets for txt2img / img2img / hires_fix, applied to cond and uncond, their residuals summed
---@field preview? string|fun(step: integer, total: integer, image: kiln.Tensor) a PNG file replaced during sampling, or a function (image [B, 3, H, W] freed after it returns)
---@field preview_every? integer previews after steps N, 2N, ... and the last (1)
---@field previewer? "latent2rgb"|"taesd"|kiln.TAESD|false how previews are made (latent2rgb: latent size; taesd: full size; false: none, the host's either)
---@field vae? "taesd"|string|kiln.TAESD decode (and encode) this run with TAESD in place of the checkpoint's VAE
---@field cache? kiln.StepCache|"fbcache"|"teacache"|"deepcache" reuse network work between sampler steps (kiln.step_cache)
---Every pipeline refuses a key it does not know: "kiln.pipeline.txt2img: unknown option
---'stpes' (did you mean 'steps'?)". kiln.pipeline.OPTIONS lists each pipeline's. A run
---computes on `device` alone (the default device is that one for the run's length).

---A step cache (kiln.step_cache): First-Block Cache, TeaCache or DeepCache.
---@class kiln.StepCache
---@field mode "fbcache"|"teacache"|"deepcache"
---@field threshold? number fbcache / teacache: reuse while the (accumulated) relative change is below it (the mode's default for the network)
---@field interval? integer deepcache: a full step every N steps (3)
---@field branch? integer deepcache: the skip branch kept (0, the shallowest)
---@field max_hits? integer consecutive reused steps at most (-1: any)
---@field coefficients? number[] teacache: the rescale polynomial, highest power first (the family's published one)

---What a pipeline run did (its third result).
---@class kiln.RunInfo
---@field evals integer full network evaluations
---@field calls integer network calls (a step cache makes some of them partial)
---@field steps integer sampler steps

---A ControlNet of a pipeline run (ComfyUI's ControlNetApplyAdvanced).
---@class kiln.ControlEntry
---@field net kiln.ControlNet from kiln.load_controlnet; loaded with the UNet, unloaded after sampling
---@field image kiln.Tensor the hint [1, 3, H, W] in [0, 1], brought to 8x the latent size as ComfyUI does (centre crop, nearest-exact)
---@field strength? number scales the residuals (1; 0 leaves the run as without)
---@field start? number fraction of the schedule (0..1) where it starts applying (0)
---@field stop? number fraction of the schedule where it stops (1; 0 never applies)

---Staged workflows: each stage loads what it needs and releases what the next does not.
---@class kiln.pipeline
kiln.pipeline = {}

---Text to image: [batch, 3, H, W] in [0, 1], and the final latents.
---@param ckpt kiln.Checkpoint
---@param opts kiln.PipelineOptions
---@return kiln.Tensor image
---@return kiln.Tensor latents
---@return kiln.RunInfo info
function kiln.pipeline.txt2img(ckpt, opts) end

---An input image [1, 3, H, W] in [0, 1] re-generated at opts.denoise.
---@param ckpt kiln.Checkpoint
---@param image kiln.Tensor
---@param opts kiln.PipelineOptions
---@return kiln.Tensor image
---@return kiln.Tensor latents
---@return kiln.RunInfo info
function kiln.pipeline.img2img(ckpt, image, opts) end

---Inpainting: image [1, 3, H, W] in [0, 1] re-drawn where mask [1, 1, H, W] (1 = repaint) is
---above 0, with a latent noise mask at every step (ComfyUI's SetLatentNoiseMask); denoise
---defaults to 1; the result is pasted onto the input through the mask feathered inward by
---opts.mask_blur pixels (default 4), so pixels where the mask is 0 come back unchanged.
---A 9-channel inpainting UNet gets ComfyUI's VAEEncodeForInpaint (grey fill, the noise mask
---grown by opts.grow_mask pixels, default 6) and the mask + masked latent after x's channels.
---@param ckpt kiln.Checkpoint
---@param image kiln.Tensor
---@param mask kiln.Tensor
---@param opts kiln.PipelineOptions|{mask_blur?: integer, grow_mask?: integer}
---@return kiln.Tensor image
---@return kiln.Tensor latents
function kiln.pipeline.inpaint(ckpt, image, mask, opts) end

---Samples small, upscales, samples again at a partial denoise.
---@param ckpt kiln.Checkpoint
---@param opts kiln.PipelineOptions
---@return kiln.Tensor image
---@return kiln.Tensor latents
---@return kiln.RunInfo info
function kiln.pipeline.hires_fix(ckpt, opts) end

---@param ckpt kiln.Checkpoint
---@return table
function kiln.pipeline.model_sampling(ckpt) end

---Checks opts.cache (filling its defaults) into the run's options and starts its RunInfo.
---@param opts kiln.PipelineOptions
---@param ckpt? kiln.Checkpoint
---@return table? spec
function kiln.pipeline.cache_spec(opts, ckpt) end

---The checkpoint's native image size: its metadata's kiln.image_size, else the
---family's (512 for SD 1.x, 768 for SD 2.x v-prediction, 1024 for SDXL).
---@param ckpt kiln.Checkpoint
---@return integer
function kiln.pipeline.image_size(ckpt) end

---The number of pixels an image's width and height must be a multiple of: the VAE's
---factor (the UNet takes any latent size).
---@param ckpt kiln.Checkpoint
---@return integer
function kiln.pipeline.size_multiple(ckpt) end

---The guidance scale used when the caller gives none: the metadata's kiln.cfg, else 7.
---@param ckpt kiln.Checkpoint
---@return number
function kiln.pipeline.default_cfg(ckpt) end

---A1111's model hash (10 hex digits of the file's SHA-256), computed once; files over
---512 MiB are skipped unless force.
---@param ckpt kiln.Checkpoint
---@param force? boolean
---@return string|nil
function kiln.pipeline.model_hash(ckpt, force) end

---@param ckpt kiln.Checkpoint
---@param scheduler kiln.SchedulerName
---@param steps integer
---@param denoise? number
---@param shape? integer[] the latents' shape (needed by a flow-matching family: Flux)
---@return kiln.Tensor
function kiln.pipeline.sigmas(ckpt, scheduler, steps, denoise, shape) end

---The family definition of a checkpoint that samples by flow matching (Flux), else nil.
---@param ckpt kiln.Checkpoint
---@return table?
function kiln.pipeline.flow_family(ckpt) end

---The model sampling (kiln.flow) of a flow family's run on latents of that shape.
---@param ckpt kiln.Checkpoint
---@param shape integer[]
---@return table
function kiln.pipeline.flow_sampling(ckpt, shape) end

---The network a run samples with: ckpt.dit (Flux) or ckpt.unet.
---@param ckpt kiln.Checkpoint
---@return kiln.Model
function kiln.pipeline.net(ckpt) end

---Conditioning: cond, uncond (and the pooled vectors where the family has them).
---@param ckpt kiln.Checkpoint
---@param prompt string
---@param negative? string
---@param enc_opts? table options of clip:encode (clip_skip, ...)
---@return kiln.Tensor cond
---@return kiln.Tensor uncond
---@return kiln.Tensor? pooled
---@return kiln.Tensor? upooled
function kiln.pipeline.encode_prompts(ckpt, prompt, negative, enc_opts) end

---The denoiser the samplers call: classifier-free guidance around the UNet.
---@param ckpt kiln.Checkpoint
---@param cond kiln.Tensor
---@param uncond kiln.Tensor
---@param cfg number
---@param opts? kiln.PipelineOptions
---@return kiln.Denoiser
function kiln.pipeline.denoiser(ckpt, cond, uncond, cfg, opts) end

---Samples latents from noise (x0 nil) or from x0 at opts.denoise < 1.
---@param ckpt kiln.Checkpoint
---@param cond kiln.Tensor
---@param uncond kiln.Tensor
---@param opts kiln.PipelineOptions
---@param x0? kiln.Tensor
---@param shape? kiln.Shape
---@return kiln.Tensor
function kiln.pipeline.sample_latents(ckpt, cond, uncond, opts, x0, shape) end

---The A1111 "parameters" text of a PNG.
---@param opts kiln.PipelineOptions
---@param ckpt kiln.Checkpoint
---@param extra? table
---@return string
function kiln.pipeline.parameters(opts, ckpt, extra) end

---Saves an image with its generation parameters.
---@param image kiln.Tensor
---@param path string
---@param opts kiln.PipelineOptions
---@param ckpt kiln.Checkpoint
---@param extra? table
---@return string path
function kiln.pipeline.save(image, path, opts, ckpt, extra) end

---The options each pipeline knows: OPTIONS.txt2img / img2img / hires_fix / inpaint, sets
---of names.
---@type table<string, table<string, boolean>>
kiln.pipeline.OPTIONS = {}

---Raises "kiln.pipeline.NAME: unknown option 'X' (did you mean 'Y'?)" at the pipeline's
---caller when opts has a key pipeline NAME does not know.
---@param name "txt2img"|"img2img"|"hires_fix"|"inpaint"
---@param opts? table
function kiln.pipeline.check_options(name, opts) end

---The options of pipeline NAME among a larger table (the command line's, with its out and
---model): a new table of the keys the pipeline knows.
---@param name "txt2img"|"img2img"|"hires_fix"|"inpaint"
---@param o table
---@return table
function kiln.pipeline.options_of(name, o) end

---The device a run on dev computes on: dev (default: the default device), but the CPU in
---memory mode "none"/"cpu".
---@param dev? kiln.DeviceName
---@return kiln.DeviceName
function kiln.pipeline.run_device(dev) end

---Makes the run's device (run_device(dev)) the default one until the result is closed
---(`local d <close> = ...`), on an error too; nil when it already is.
---@param dev? kiln.DeviceName
---@return table?
function kiln.pipeline.on_device(dev) end

---The measured peak of every device that held bytes since kiln.mem.reset_peak, as the
---PNG's kiln.peak text: "cpu: 80.2 MiB, sim: 459.1 MiB" (nil when none did).
---@return string?
function kiln.pipeline.peak_text() end

-- ---------------------------------------------------------------- kiln.util, kiln.cli

---@class kiln.util
kiln.util = {}

---Parses "--name value" / "--flag" arguments over defaults; an unknown option or a bad
---value raises a usage error.
---@param args string[]
---@param defaults table
---@return table
function kiln.util.parse_args(args, defaults) end

---Raises a usage error, {kind = "usage", message = msg} with a __tostring: the kiln
---program prints "kiln: msg" and exits with status 2, without a traceback.
---@param msg string
function kiln.util.usage_error(msg) end

---The edit distance of two strings: insertions, deletions, substitutions and swaps of
---two neighbours, each costing one.
---@param a string
---@param b string
---@return integer
function kiln.util.edit_distance(a, b) end

---The name of names (a list, or a set's keys) nearest to name by edit distance, or nil
---when none is within a third of the longer name (at least 2).
---@param name string
---@param names table
---@return string?
function kiln.util.nearest(name, names) end

---Raises "WHO: unknown option 'X' (did you mean 'Y'?)" (or the known names when none is
---near) at `level` when opts has a key that is not in the set known. Returns opts.
---@param opts? table
---@param known table<string, boolean>
---@param who string
---@param level? integer
---@return table?
function kiln.util.check_options(opts, known, who, level) end

---x rounded to the nearest whole number, halves to the even neighbour (Python's round,
---numpy.rint); an integer when it is one.
---@param x number
---@return number
function kiln.util.round_half_even(x) end

---@param e any
---@return boolean
function kiln.util.is_usage_error(e) end

---Whether e is the runtime's out-of-memory error (a table with kind "oom").
---@param e any
---@return boolean
function kiln.util.is_oom(e) end

---"[a, b, c]": a shape (a list of sizes) or a tensor's shape, for messages.
---@param x integer[]|kiln.Tensor
---@return string
function kiln.util.shape_str(x) end

---Raises "WHO: 'path': msg" (or "WHO: msg" without a path) as a string error at level (default 0).
---@param who string
---@param path string?
---@param msg string
---@param level integer?
function kiln.util.file_error(who, path, msg, level) end

---The keys of a table, sorted.
---@param t table
---@return any[]
function kiln.util.sorted_keys(t) end

---file in dir or below it (the shallowest match, first in sorted order), or nil.
---@param dir string
---@param file string
---@return string?
function kiln.util.find_file(dir, file) end

--- Number of distinct indices matched by `pattern`'s capture in a name -> shape table
--- (max index + 1): how many blocks, layers or levels a checkpoint has.
---@param shapes table<string, integer[]>
---@param pattern string
---@return integer
function kiln.util.count_indices(shapes, pattern) end

--- The shape of tensor `name`; raises naming the network, the tensor and `what` it was
--- needed for when it is absent.
---@param shapes table<string, integer[]>
---@param name string
---@param what string
---@param net string
---@return integer[]
function kiln.util.need_shape(shapes, name, what, net) end

---The options the example workflows share (--device, --mode, --vram, --quiet, ...).
---@class kiln.cli
kiln.cli = {}

---Parses args with the common options plus `extra` defaults, checks their values (a
---mistake is a usage error) and applies the runtime ones through kiln.configure.
---@param args string[]
---@param extra? table<string, any> a script's own options and their defaults
---@param help? table<string, string> what each of them does (--help)
---@return table
function kiln.cli.parse(args, extra, help) end

---Fills opts.width / opts.height with the checkpoint's size where none was given and
---checks them (and, with scale, the scaled sizes) in pixels; a usage error otherwise.
---@param opts table
---@param ckpt kiln.Checkpoint
---@param scale? number
---@return table opts
function kiln.cli.image_size(opts, ckpt, scale) end

---The --help text of an example script: its options with what they do and their defaults.
---@param defaults table<string, any>
---@param help? table<string, string> what a script's own options do
---@return string
function kiln.cli.usage(defaults, help) end

---"6G", "512M", "1.5GiB", "300000000" -> bytes (kiln.parse_size); a usage error otherwise.
---@param s string
---@return integer
function kiln.cli.parse_size(s) end

-----cache MODE[:N] as a pipeline's opts.cache (nil for ""); N is fbcache's / teacache's
---threshold, deepcache's interval; a usage error names a mistake.
---@param s string
---@return kiln.StepCache?
function kiln.cli.cache_option(s) end

---@return string
function kiln.cli.script_dir() end

---The bundled demo model.
---@return string
function kiln.cli.default_model() end

---Prints what a run wrote and where the memory went (unless quiet).
---@param path string|string[]
---@param opts table
function kiln.cli.report(path, opts) end

-----clip-skip against the checkpoint's text encoders (a usage error past their layers).
---@param opts table
---@param ckpt kiln.Checkpoint
---@return table opts
function kiln.cli.check_clip_skip(opts, ckpt) end

---The --reference PNGs as images [1, C, H, W] in [0, 1] (nil when none); a file that is
---not a PNG is a usage error naming it.
---@param paths string[]|nil
---@return kiln.Tensor[]|nil images
function kiln.cli.reference_images(paths) end

----reference against the checkpoint: only Flux Kontext takes reference pictures; any
---other family is a usage error naming it.
---@param opts table
---@param ckpt kiln.Checkpoint
---@return table opts
function kiln.cli.check_reference(opts, ckpt) end

---The files a run of n images writes: out for one, else out with _1, _2... before
---its extension.
---@param out string
---@param n integer
---@return string[]
function kiln.cli.out_paths(out, n) end

---Saves each image of a batch [N, C, H, W] with its parameters at
---cli.out_paths(opts.out, N).
---@param image kiln.Tensor
---@param opts table
---@param ckpt kiln.Checkpoint
---@param extra? table
---@return string[] paths
function kiln.cli.save(image, opts, ckpt, extra) end

---The kiln.load_checkpoint options the command line sets (--loras, --embeddings).
---@param opts table
---@return table
function kiln.cli.checkpoint_options(opts) end

---A1111's extra-network prompt syntax (<lora:NAME:W>) and the run's LoRAs.
kiln.extra_networks = {}

---@class kiln.LoraUse
---@field name string
---@field unet number
---@field clip number
---@field path? string

---The prompt without its <lora:...> tags, and the LoRAs they name.
---@param prompt string
---@return string prompt
---@return kiln.LoraUse[]
function kiln.extra_networks.parse(prompt) end

---"NAME", "NAME:W" or "NAME:TE:UNET" (the --lora option).
---@param s string
---@return kiln.LoraUse
function kiln.extra_networks.parse_option(s) end

---A LoRA file's short hash for A1111's "Lora hashes" (12 hex digits), nil when not safetensors.
---@param path string
---@return string?
function kiln.extra_networks.lora_hash(path) end

---Applies LoRAs to a checkpoint; closing the result removes them.
---@param ckpt kiln.Checkpoint
---@param list kiln.LoraUse[]
---@return table
function kiln.extra_networks.apply(ckpt, list) end

---The LoRAs of a run: opts.lora, then the prompt's tags.
---@param opts table
---@return string prompt
---@return kiln.LoraUse[]
function kiln.extra_networks.of_run(opts) end

---The `Lora hashes: "..."` field of a run's PNG parameters, or nil.
---@param ckpt kiln.Checkpoint
---@param opts table
---@return string?
function kiln.extra_networks.hashes_field(ckpt, opts) end

-- ---------------------------------------------------------------- kiln.Tensor

---A view of a reference-counted storage: dtype, shape, strides, device. Operators
---+ - * / ^ and unary - work with tensors and numbers; t[i] indexes the first dimension.
---Whole-tensor reductions (t:sum() with no dim) return Lua numbers.
---@class kiln.Tensor
---@field shape kiln.Shape
---@field dtype kiln.DType
---@field device kiln.DeviceName
---@field ndim integer
---@operator add(kiln.Tensor|number): kiln.Tensor
---@operator sub(kiln.Tensor|number): kiln.Tensor
---@operator mul(kiln.Tensor|number): kiln.Tensor
---@operator div(kiln.Tensor|number): kiln.Tensor
---@operator pow(kiln.Tensor|number): kiln.Tensor
---@operator unm: kiln.Tensor
---@operator len: integer
local Tensor = {}

---Frees the memory now (later use raises, naming where it was freed). Also <close>.
function Tensor:free() end

---The values as nested Lua tables.
---@return table|number
function Tensor:table() end

---The value of a one-element tensor.
---@return number
function Tensor:item() end

---@return integer
function Tensor:numel() end

---@return integer
function Tensor:nbytes() end

---@return integer
function Tensor:dim() end

---The shape, or the size of one dimension.
---@param dim? integer
---@return kiln.Shape|integer
function Tensor:size(dim) end

---Strides in elements.
---@return integer[]
function Tensor:stride() end

---@return boolean
function Tensor:is_contiguous() end

---A view with a new shape when possible, else a copy.
---@param shape kiln.Shape|integer
---@param ... integer
---@return kiln.Tensor
function Tensor:reshape(shape, ...) end

---Same as reshape.
---@param shape kiln.Shape|integer
---@param ... integer
---@return kiln.Tensor
function Tensor:view(shape, ...) end

---@param dims integer[]|integer
---@param ... integer
---@return kiln.Tensor
function Tensor:permute(dims, ...) end

---@param dim0 integer
---@param dim1 integer
---@return kiln.Tensor
function Tensor:transpose(dim0, dim1) end

---A view of `length` entries of dim from start (1-based; negative from the end).
---@param dim integer
---@param start integer
---@param length integer
---@return kiln.Tensor
function Tensor:narrow(dim, start, length) end

---The view at index i of dim, without that dimension.
---@param dim integer
---@param index integer
---@return kiln.Tensor
function Tensor:select(dim, index) end

---Removes dim (or every dimension of size 1).
---@param dim? integer
---@return kiln.Tensor
function Tensor:squeeze(dim) end

---@param dim integer
---@return kiln.Tensor
function Tensor:unsqueeze(dim) end

---A broadcast view.
---@param shape kiln.Shape|integer
---@param ... integer
---@return kiln.Tensor
function Tensor:expand(shape, ...) end

---@return kiln.Tensor
function Tensor:contiguous() end

---@return kiln.Tensor
function Tensor:clone() end

---Copies src into this tensor (broadcast, converted); returns self.
---@param src kiln.Tensor
---@return kiln.Tensor
function Tensor:copy(src) end

---Fills with value; returns self.
---@param value number
---@return kiln.Tensor
function Tensor:fill(value) end

---A copy with another dtype and/or on another device.
---@param a kiln.DType|kiln.DeviceName
---@param b? kiln.DType|kiln.DeviceName
---@return kiln.Tensor
function Tensor:to(a, b) end

---Moves the data to another device in place (the same object, over a contiguous
---copy there; the old storage is released); returns self.
---@param device kiln.DeviceName
---@return kiln.Tensor
function Tensor:move(device) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:add(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:sub(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:mul(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:div(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:pow(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:minimum(other) end

---@param other kiln.Tensor|number
---@return kiln.Tensor
function Tensor:maximum(other) end

---@return kiln.Tensor
function Tensor:neg() end

---@return kiln.Tensor
function Tensor:exp() end

---@return kiln.Tensor
function Tensor:log() end

---@return kiln.Tensor
function Tensor:sqrt() end

---@return kiln.Tensor
function Tensor:abs() end

---@return kiln.Tensor
function Tensor:tanh() end

---@return kiln.Tensor
function Tensor:sigmoid() end

---@return kiln.Tensor
function Tensor:sin() end

---@return kiln.Tensor
function Tensor:cos() end

---@return kiln.Tensor
function Tensor:relu() end

---@param lo? number
---@param hi? number
---@return kiln.Tensor
function Tensor:clamp(lo, hi) end

---Sum over dim (a tensor), or of everything (a number).
---@param dim? integer
---@param keepdim? boolean
---@return kiln.Tensor|number
function Tensor:sum(dim, keepdim) end

---@param dim? integer
---@param keepdim? boolean
---@return kiln.Tensor|number
function Tensor:mean(dim, keepdim) end

---@param dim? integer
---@param keepdim? boolean
---@return kiln.Tensor|number
function Tensor:max(dim, keepdim) end

---@param dim? integer
---@param keepdim? boolean
---@return kiln.Tensor|number
function Tensor:min(dim, keepdim) end

---Variance (unbiased unless the 3rd argument is false).
---@param dim? integer
---@param keepdim? boolean
---@param unbiased? boolean
---@return kiln.Tensor|number
function Tensor:var(dim, keepdim, unbiased) end

---@param other kiln.Tensor
---@return kiln.Tensor
function Tensor:matmul(other) end

-- ---------------------------------------------------------------- kiln.Model

---@class kiln.ModelStats
---@field tensors integer
---@field mapped integer
---@field host integer
---@field device integer
---@field file_bytes integer
---@field host_bytes integer
---@field device_bytes integer

---A named set of weight tensors over mapped .safetensors files, each tensor resident
---"mapped", on the "host" or on the "device". m.name, m.residency, m.device, m.pinned,
---m.closed are properties; m[name] is the tensor of that name; #m the tensor count.
---@class kiln.Model
---@field name string
---@field device string|nil
---@field streamed boolean loads keep the weights on the host for streaming, whatever the mode
---@field pinned boolean
---@field closed boolean
---@field residency {mapped: integer, host: integer, device: integer, tensors: integer, target?: string}
local Model = {}

---Copies the weights to a device (converting the dtype if asked); returns self.
---@param device? kiln.DeviceName
---@param opts? kiln.DType|{dtype?: kiln.DType}
---@return kiln.Model
function Model:load(device, opts) end

---on: later loads keep the weights on the host for streaming whatever the memory mode
---(the networks' partial residency, part:load(dev, {resident = bytes})); "whole": later
---loads put every weight on the device, in mode "low" too (a residency of all its bytes);
---false: the memory mode decides. Returns self.
---@param on boolean|"whole"
---@return kiln.Model
function Model:set_streamed(on) end

---Moves the device copies to host memory; returns self.
---@return kiln.Model
function Model:offload() end

---Drops every copy but the mapped file; returns self.
---@return kiln.Model
function Model:unload() end

---Keeps the model from being evicted; returns self.
---@return kiln.Model
function Model:pin() end

---@return kiln.Model
function Model:unpin() end

---Bytes of the model's copies on a device (all host and device copies when nil).
---@param device? kiln.DeviceName
---@return integer
function Model:bytes(device) end

---The tensor of that name, where it is resident now.
---@param name string
---@return kiln.Tensor
function Model:tensor(name) end

---@param name string
---@return boolean
function Model:has(name) end

---Sorted tensor names.
---@return string[]
function Model:names() end

---Streaming ("low" mode): brings tensors to the device now; returns self.
---@param names string|string[]
---@return kiln.Model
function Model:fetch(names) end

---Streaming: drops the device copies of tensors; returns self.
---@param names string|string[]
---@return kiln.Model
function Model:release(names) end

---Streaming: starts copying tensors to the device in the background; returns self.
---@param names string|string[]
---@return kiln.Model
function Model:prefetch(names) end

---@param name string
---@return kiln.Residency
function Model:where(name) end

---@return kiln.ModelStats
function Model:stats() end

---A weight patch: every copy of `target` is built as f32(file) + each patch's delta
---(in the order added; DoRA normalizes), cast to the copy's dtype; existing copies are
---rebuilt now. spec: kind ("lora"|"loha"|"lokr"|"diff"), scale (strength and alpha/rank
---folded in; default 1), strength (DoRA's mix, default 1), factors as tensors (lora: up,
---down, mid; loha: w1a, w1b, w2a, w2b, t1, t2; lokr: w1 or w1a+w1b, w2 or w2a+w2b, t2;
---diff: diff), dora_scale, rows = {first, count} (rows of dim 1). Returns the patch's id.
---@param target string
---@param spec table
---@return integer
function Model:add_patch(target, spec) end

---Removes a patch; the tensor's copies are rebuilt from the file, bit for bit.
---@param id integer
---@return kiln.Model
function Model:remove_patch(id) end

---Patches on one tensor, or in the whole model.
---@param target? string
---@return integer
function Model:patch_count(target) end

---Releases the model (also <close> and the garbage collector).
function Model:close() end

-- ---------------------------------------------------------------- kiln.Tokenizer

---CLIP's byte-level BPE (kiln.tokenizer); :free(), <close> and the GC release it.
---@class kiln.Tokenizer
local Tokenizer = {}

---Token ids of text, without the start and end tokens.
---@param text string
---@return integer[]
function Tokenizer:encode(text) end

---@param ids integer[]
---@return string
function Tokenizer:decode(ids) end

---The start-of-text token id.
---@return integer
function Tokenizer:bos() end

---The end-of-text token id.
---@return integer
function Tokenizer:eos() end

---The id of a vocabulary entry ("cat</w>"), nil when absent.
---@param token string
---@return integer|nil
function Tokenizer:token_id(token) end

---@return integer
function Tokenizer:vocab_size() end

---The path it was opened from, or "built-in CLIP vocabulary".
---@return string
function Tokenizer:source() end

function Tokenizer:free() end

-- ---------------------------------------------------------------- checkpoints

---@class kiln.Checkpoint
---@field clip kiln.CLIP
---@field unet kiln.UNet
---@field dit? kiln.Flux the transformer of a Flux checkpoint (instead of unet)
---@field vae kiln.VAE
---@field family "sd1"|"sd2"|"sdxl"|"flux"
---@field variant? "dev"|"schnell" a Flux checkpoint's (guidance_in present: dev)
---@field shift_factor number the latent's shift (Flux 0.1159; 0 for SD)
---@field path string
---@field image_size integer
---@field lora_dir? string the {loras = DIR} folder
---@field embedding_dir? string the {embeddings = DIR} folder
---@field loras_applied? kiln.Lora[] the LoRAs added and not removed
---@field few_step? kiln.FewStepKind an SD-Turbo / SDXL-Turbo / LCM... checkpoint as its file says
local Checkpoint = {}

---Closes clip, unet and vae (also <close>).
function Checkpoint:close() end

---Applies a LoRA-family file (kohya, PEFT / diffusers, LyCORIS LoHa / LoKr / full, DoRA)
---as patches of the UNet's and text encoders' weight stores: before or after load, in
---every memory mode; several stack. Unmatched keys give a warning (and h.unmatched).
---@param path string a .safetensors file
---@param opts? {unet?: number, clip?: number, name?: string}
---@return kiln.Lora
function Checkpoint:add_lora(path, opts) end

---The path of NAME.safetensors in the folder given as load_checkpoint's {loras = DIR}
---(subfolders searched, case-sensitive); an error naming the folder when missing.
---@param name string
---@return string
function Checkpoint:find_lora(name) end

---An applied LoRA (ckpt:add_lora); also <close>, which removes it.
---@class kiln.Lora
---@field name string
---@field path string
---@field format string
---@field family? "sd1"|"sd2"|"sdxl"
---@field patched integer weights it changes
---@field unmatched string[] its keys that match no weight
---@field unet number
---@field clip number
---@field few_step? kiln.FewStepKind an LCM-LoRA...: the pipelines sample as its kind unless told
local Lora = {}

---Takes the LoRA's patches off (the weights come back bit for bit); idempotent.
---@return kiln.Lora
function Lora:remove() end

---Adds a textual-inversion embedding (.safetensors: emb_params, string_to_param.*, or
---SDXL's clip_l + clip_g), checked against the text encoders' widths; prompts use it
---as embedding:NAME (NAME defaults to the file's stem). .pt files are refused.
---@param path string
---@param name? string
---@return {name: string, path: string, count: integer}
function Checkpoint:add_embedding(path, name) end

---The text encoder(s); also a kiln.Model (load, offload, unload, bytes, close).
---@class kiln.CLIP: kiln.Model
---@field tokenizer kiln.Tokenizer
---@field tokenizer_source string which tokenizer load_checkpoint chose, and why
local CLIP = {}

---Token ids: 77 per window (start, tokens, end, padded with the end token).
---@param text string
---@return integer[]
function CLIP:tokenize(text) end

---Conditioning [1, 77 k, dim] (and the pooled vector where the family has one);
---parses the emphasis syntax (word:1.2) and embedding:NAME (added with
---ckpt:add_embedding, else NAME.safetensors in the {embeddings = DIR} folder).
---opts: clip_skip, emphasis = false, comma_backtrack, weighting = "a1111" (default:
---scale, keep the mean) | "comfy" (ComfyUI's parse; (z - z_empty) * w + z_empty) | "none",
---max_chunks: the most 75-token chunks the prompt may take (default
---require("kiln.clip").max_chunks, 32; math.huge: none); a longer prompt is an error that
---names the limit and how to raise it. Time is linear in the prompt's length.
---@param text string
---@param opts? {clip_skip?: integer, emphasis?: boolean, comma_backtrack?: integer, weighting?: "a1111"|"comfy"|"none", max_chunks?: integer}
---@return kiln.Tensor cond
---@return kiln.Tensor? pooled
function CLIP:encode(text, opts) end

---The denoising network; also a kiln.Model.
---@class kiln.UNet: kiln.Model
local UNet = {}

---The raw network output (epsilon or v).
---@param x kiln.Tensor latents [B, 4, h, w]
---@param t kiln.Tensor timesteps [B] (0-999)
---@param context kiln.Tensor [B, L, dim]
---@param y? kiln.Tensor SDXL's pooled / size vector
---@param opts? {control?: kiln.Tensor[]} a ControlNet's residuals (cn:forward)
---@return kiln.Tensor
function UNet:forward(x, t, context, y, opts) end

---Black Forest Labs' Flux.1 transformer ([dev], [schnell]); also a kiln.Model (streams
---block by block in mode "low").
---@class kiln.Flux: kiln.Model
---@field config table hyper-parameters read from the shapes (hidden, heads, depth, depth_single, guidance, axes_dim, ...)
local Flux = {}

---The velocity, as BFL's Flux.forward on the latent packed in 2x2 patches with
---`prepare`'s position ids.
---Kontext: opts.reference, a reference latent [1 or B, 16, hr, wr] (hr, wr even) or a list, appended as
---image tokens with index 1 (BFL's prepare_kontext; several placed as ComfyUI's "offset"), their
---prediction dropped.
---@param x kiln.Tensor latents [B, 16, h, w] (h, w even)
---@param t kiln.Tensor|number flow time [B] in [0, 1]
---@param context kiln.Tensor T5 states [B, L, d]
---@param y kiln.Tensor CLIP-L's pooled output [B, d_pooled]
---@param opts? {guidance?: number|kiln.Tensor, reference?: kiln.Tensor|kiln.Tensor[]} distilled guidance ([dev] needs it; [schnell] ignores it), Kontext's references
---@return kiln.Tensor
function Flux:forward(x, t, context, y, opts) end

---The autoencoder; also a kiln.Model.
---@class kiln.VAE: kiln.Model
local VAE = {}

---Latents (already times the scale factor) -> images [B, 3, 8h, 8w] in [0, 1].
---Tiled decodes match the untiled one (image-wide GroupNorm statistics); mid =
---"tiled" also tiles the mid block so the device peak does not grow with the image.
---@param z kiln.Tensor
---@param opts? {tile?: integer|"auto", overlap?: integer, blend?: "cosine"|"linear", mid?: "untiled"|"tiled", min_tile?: integer, retry?: boolean}
---@return kiln.Tensor
function VAE:decode(z, opts) end

---Images in [0, 1] -> latents (the posterior's mode times the scale factor).
---@param image kiln.Tensor
---@param opts? {tile?: integer|"auto", overlap?: integer}
---@return kiln.Tensor
function VAE:encode(image, opts) end

-- ---------------------------------------------------------------- kiln.comfy

---Options of kiln.comfy.run.
---@class kiln.ComfyOptions
---@field models? string ComfyUI's models folder (checkpoints/, loras/, controlnet/, upscale_models/, embeddings/, input/)
---@field output? string where SaveImage writes PREFIX_00001_.png ("output")
---@field input? string LoadImage's folder (default models/input)
---@field device? string the run's device (default kiln.default_device())
---@field keep_all? boolean keep every result and model to the end (ComfyUI's way), for comparison
---@field dry_run? boolean only check and plan: the report's text is the schedule with estimates
---@field quiet? boolean no per-node lines on stderr

---ComfyUI workflows in the API format, each result freed after its last reader.
---@class kiln.comfy
kiln.comfy = {}

---Runs a workflow (a .json or .png path, JSON text or a decoded table). Returns the files
---written and a report {nodes = {{id, class_type, peak, seconds}...}, peak, previews}
---(with dry_run: {plan, text}). Bad graphs and values outside a node's spec raise
---"kiln.comfy: ..." before anything runs. A node's peak is the device's highest bytes while
---it ran (its stage in kiln.mem.timeline); the device's own peak counter is left alone, so
---kiln.mem.reset_peak before and kiln.mem.stats after measure the whole run.
---@param src string|table
---@param opts? kiln.ComfyOptions
---@return string[] files
---@return table report
function kiln.comfy.run(src, opts) end

---The workflow checked and scheduled, with each node's estimate; nothing runs.
---@param src string|table
---@param opts? kiln.ComfyOptions
---@return table plan
function kiln.comfy.plan(src, opts) end

---The text chunks of a PNG (key -> text; false for a compressed one).
---@param path string
---@return table<string, string|false>
function kiln.comfy.png_text(path) end

---The node types kiln runs (built in and added with kiln.comfy.add_node), sorted.
---@return string[]
function kiln.comfy.supported() end

---One input of a node definition: {name, type, default =, min =, max =, step =, optional =}.
---type: "INT", "FLOAT", "STRING", "BOOLEAN", a list of values (a combo: the value must be
---one of them; its default the first), "COMBO" with `choices` (a list or a function
---returning one), "FILE:<folder>" (a file name found under the models folder, e.g.
---"FILE:checkpoints"; "FILE:input" for LoadImage's pictures) or an upper-case link type
---("MODEL", "CLIP", "VAE", "LATENT", "IMAGE", "MASK", "CONDITIONING", ... any name a node
---outputs). min/max/step/default as ComfyUI's INPUT_TYPES gives them: a value outside
---[min, max] or not in a combo's list is refused before the run, naming the node id,
---class, input, value and range; a value left out takes its default; an optional input
---without one is nil in the run's arguments.
---@class kiln.ComfyInput
---@field [1] string the input's name as workflows spell it
---@field [2] string|(string|number)[] its type, or a combo's list
---@field default? any the value a workflow may leave out (not for links)
---@field min? number INT / FLOAT: the smallest value taken
---@field max? number INT / FLOAT: the largest value taken
---@field step? number INT / FLOAT: the widget's step (ComfyUI checks only min and max; so does kiln)
---@field round? number FLOAT: ComfyUI's rounding of the widget
---@field optional? boolean may be left out (ComfyUI's "optional" inputs)
---@field choices? string[]|fun(): string[] a COMBO's values
---@field tooltip? string
---@field multiline? boolean

---A node definition for kiln.comfy.add_node. run(ctx, args) gets each input by name (a
---linked input as the value the other node produced: {type = T, ...}, an IMAGE's tensor
---in .t, a LATENT's in .samples, a MASK's in .t, a literal output's number or string in
---.value) and returns the list of its outputs, one value per entry of `outputs`, made with
---ctx:image(t), ctx:latent(samples [, noise_mask]), ctx:mask(t) or
---ctx:value(type, fields [, tensors, models]) (the tensors listed are freed after their
---last reader). ctx:fail(msg) raises naming the node; ctx.device is the run's device.
---@class kiln.ComfyNode
---@field inputs? kiln.ComfyInput[]
---@field outputs string[] the types it returns ({} for an output node)
---@field run fun(ctx: table, args: table): table
---@field output? boolean an output node (SaveImage, PreviewImage): the graph runs what leads to one
---@field category? string ComfyUI's menu path ("image/upscaling")
---@field description? string
---@field model_file? string the FILE: input naming a UNet file (the graph's latent scale comes from it)

---Adds a node type for the workflows run after it (kiln.comfy.run / plan, `kiln comfy`),
---or with opts.replace = true replaces one (a built-in one too). The definition is checked
---whole first; a bad one raises "kiln.comfy.add_node: NAME: ..." naming the field.
---@param name string the class_type workflows use
---@param def kiln.ComfyNode
---@param opts? {replace?: boolean}
---@return table definition the stored definition
function kiln.comfy.add_node(name, def, opts) end

---A checked and scheduled plan as text: a line per node with its estimated (or, after a
---dry run, predicted) peak and what is freed after it.
---@param plan table from kiln.comfy.plan
---@param opts? kiln.ComfyOptions
---@return string
function kiln.comfy.format_plan(plan, opts) end

---Bytes as text ("1.5 MiB").
---@param bytes integer
---@return string
function kiln.comfy.human(bytes) end

---`kiln comfy FILE.json|FILE.png --models DIR [--output DIR] ...`: the command line's
---arguments (or one list of them).
---@param ... string
function kiln.comfy.main(...) end

-- ---------------------------------------------------------------- errors

---The error value of an out-of-memory or a cancel; tostring(e) gives its message.
---@class kiln.Error
---@field kind "oom"|"cancelled"
---@field message string
---@field device? string
---@field requested? integer
---@field free? integer
---@field budget? integer
local Error = {}

return kiln
