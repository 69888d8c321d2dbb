/* model.h - model weight stores and their residency, memory modes and eviction.
 * A model is a named set of weight tensors from one or more safetensors files,
 * opened by mmap (nothing read until used). Each tensor has up to three copies:
 * mapped (a view of the file, always there), host (in the cpu allocator: a
 * converted dtype, or what offload kept) and device (on the device it was loaded
 * to). Copies are accounted to the owner "model:<name>". Device copies of unpinned
 * models are evicted, least recently used first, when an allocation needs room
 * (memory mode "normal"). In mode "low" weights stay on the host and are streamed:
 * fetch / prefetch (a copy thread per device) / release, tensor by tensor. The end
 * of a dry run (meta.h) drops the copies the run made: model.c registers that as
 * meta's end hook when the first model opens.
 *
 * Thread-safety: a model may be used by one thread at a time (plus the runtime's
 * own copy threads); eviction may come from any thread. */
#ifndef KILN_MODEL_H
#define KILN_MODEL_H

#include "adapter_delta.h"
#include "tensor.h"

/* Patches (weight adapters: LoRA and its family). The mapped file is never written
 * and no patched copy is kept to undo from: a tensor carries a list of patches, and
 * every copy of it (host copy, device load, low-mode fetch / prefetch on the copy
 * thread) is built as f32(mapped) + each patch's delta in the order added (DoRA
 * normalizing where a patch has a dora_scale), then cast to the copy's dtype. A
 * patched tensor's mapped view is never handed out. Adding or removing a patch
 * rebuilds the copies that exist in place, so a removal gives back the file's bits. */

/* ORDER MEMMODE: keep memory_mode_names in model.c in this order */
typedef enum {
    KILN_MEM_HIGH = 0,   /* loaded models stay on the device; nothing is evicted: OOM instead */
    KILN_MEM_NORMAL,     /* least recently used unpinned models are evicted when room is needed */
    KILN_MEM_LOW,        /* weights stay on the host; fetch/prefetch/release stream them */
    KILN_MEM_NONE,       /* everything runs from host memory: load goes to the cpu */
    KILN_MEM_MODE_COUNT
} kiln_memory_mode;

void kiln_memory_mode_set(kiln_memory_mode mode);
kiln_memory_mode kiln_memory_mode_get(void);
const char *kiln_memory_mode_name(kiln_memory_mode mode);
/* "high", "normal", "low", "none" (and "cpu" for none); -1 when unknown. */
int kiln_memory_mode_from_name(const char *name);

/* ORDER RESIDENCY */
typedef enum { KILN_RES_MAPPED = 0, KILN_RES_HOST, KILN_RES_DEVICE, KILN_RES_COUNT } kiln_residency;
const char *kiln_residency_name(kiln_residency r);

typedef struct kiln_model kiln_model;

/* Opens n safetensors files as one model (a later file's tensor replaces an
 * earlier one of the same name). name NULL: the first file's base name. */
kiln_status kiln_model_open(const char *const *paths, int n, const char *name, kiln_model **out);
/* The same, keeping only the tensors whose names start with one of the prefixes
 * (names stay whole): one part of a single-file checkpoint ("first_stage_model.").
 * No prefixes keeps everything; no tensor matching is an error. */
kiln_status kiln_model_open_prefixed(const char *const *paths, int n, const char *name,
                                     const char *const *prefixes, int n_prefixes, kiln_model **out);
/* Frees every copy (tensors handed out keep their own storage alive) and the model.
 * Waits for this model's prefetches. */
void kiln_model_close(kiln_model *m);

const char *kiln_model_name(const kiln_model *m);
int kiln_model_count(const kiln_model *m);
/* Name of tensor i (0 <= i < count), in file order. */
const char *kiln_model_tensor_name(const kiln_model *m, int i);
/* Index of name or -1. */
int kiln_model_find(const kiln_model *m, const char *name);

/* Copies every tensor to dev (converting floating-point tensors to dtype; dtype -1
 * keeps each tensor's dtype), accounted to "model:<name>". Tensors already there
 * are kept, so a load of a resident model is cheap: call it before each use. Host
 * copies are freed once the device copies exist. Mode "none" loads to the cpu;
 * mode "low" makes host copies only where a dtype conversion needs one and
 * remembers dev as the streaming target. On failure the device copies made by this
 * call are freed (the model falls back to host/mapped copies). */
kiln_status kiln_model_load(kiln_model *m, kiln_device *dev, int dtype);
/* on > 0: later loads of m behave as in mode "low" whatever the memory mode (weights
 * stay on the host, the target is remembered for fetch / prefetch / release): a
 * partial residency, where the caller keeps some blocks fetched and streams the others.
 * on < 0: later loads put every weight on the device, in mode "low" too (a residency
 * of all the model's bytes; a fetch of a loaded tensor copies nothing, and a release
 * keeps it). 0: the memory mode decides. kiln_model_stream_always gives 1, -1 or 0. */
void kiln_model_set_stream_always(kiln_model *m, int on);
int kiln_model_stream_always(const kiln_model *m);
/* Device copies become host copies (on the cpu allocator). */
kiln_status kiln_model_offload(kiln_model *m);
/* Drops every copy but the mapping. */
void kiln_model_unload(kiln_model *m);
/* Pinned models are never evicted (pins nest). */
void kiln_model_pin(kiln_model *m);
kiln_status kiln_model_unpin(kiln_model *m);

/* The best copy of a tensor (device, else host, else mapped) as a new reference;
 * touches the model's LRU clock. A missing name is an error naming the tensor, the
 * model and the closest names. */
kiln_status kiln_model_tensor(kiln_model *m, const char *name, kiln_tensor **out);
kiln_status kiln_model_where(kiln_model *m, const char *name, kiln_residency *out);

/* Streaming (any mode; needs a load target). fetch copies the named tensors to the
 * target device now (waiting for a prefetch of the same tensor in flight) and marks
 * them in use; release frees the device copies that fetch/prefetch made; prefetch
 * takes the copies' memory on the target device, queues the copying on the device's
 * copy thread and returns (in a dry run, or with kiln_model_set_prefetch_at_once(1),
 * it makes the copies before returning): the memory is held from the prefetch on in
 * both, so a dry run's peak is the real run's. */
kiln_status kiln_model_fetch(kiln_model *m, const char *const *names, int n);
kiln_status kiln_model_release(kiln_model *m, const char *const *names, int n);
kiln_status kiln_model_prefetch(kiln_model *m, const char *const *names, int n);
/* Waits until no prefetch of any model is queued or copying (a suspension moves the
 * device blocks the copy threads write into). */
void kiln_model_wait_copies(void);
/* Prefetches copy at once on the calling thread instead of on the copy thread (as a
 * dry run's always do: its peak then counts the next block's weights through the
 * block that runs meanwhile). Off by default; tests turn it on to compare a real run's
 * peak with a dry run's without the copy thread's timing in it. Process-wide. */
void kiln_model_set_prefetch_at_once(int on);
int kiln_model_prefetch_at_once(void);
/* Tests: the copy thread waits this many seconds after each copy before installing it
 * (a copy thread that gets no core); 0 (the default) turns it off. Process-wide. */
void kiln_model_set_copy_delay(double seconds);

/* Adds a patch to tensor `target` (a floating-point tensor of m): the store keeps
 * views of a's factors (their storages stay alive until the patch goes). row_count
 * > 0 restricts the delta to rows row_first .. row_first + row_count - 1 (0-based)
 * of dim 0 (a q, k or v slice of a fused in_proj weight or bias); 0 means the whole
 * tensor. The delta is reshaped to the target's (or slice's) shape when the element
 * counts agree. Waits for a prefetch of the tensor in flight, then rebuilds its
 * copies; on failure nothing is added (copies that could not be rebuilt are
 * dropped: the file gives them back). *id: the patch's id, > 0, unique in m. */
kiln_status kiln_model_add_patch(kiln_model *m, const char *target, const kiln_adapter *a, int64_t row_first,
                                 int64_t row_count, int *id);
/* Removes patch id and rebuilds the tensor's copies from the file (a host copy that
 * existed only to show the patched values goes instead). Unknown id: an error. */
kiln_status kiln_model_remove_patch(kiln_model *m, int id);
/* Patches on tensor target, or in the whole model when target is NULL; -1 when
 * target is not a tensor of m. */
int kiln_model_patch_count(kiln_model *m, const char *target);
/* Accounts the model's memory to "<kind>:<name>" instead of "model:<name>" (a LoRA
 * file opened as a model: "lora:<name>"). kind: letters, digits, '_' or '-'. */
kiln_status kiln_model_set_owner_kind(kiln_model *m, const char *kind);
const char *kiln_model_owner(const kiln_model *m);

typedef struct {
    int n_tensors;
    int count[KILN_RES_COUNT];           /* tensors whose best copy is mapped / host / device */
    uint64_t bytes[KILN_RES_COUNT];      /* bytes of those best copies */
    uint64_t file_bytes;                 /* bytes of the mapped tensors */
    uint64_t host_bytes, device_bytes;   /* all host / device copies held */
    const kiln_device *device;           /* load target, NULL when none */
    int dtype;                           /* load dtype or -1 */
    int pinned;                          /* pin count */
    uint64_t last_used;                  /* LRU clock value */
    /* streaming counters */
    uint64_t n_fetch_copies, n_prefetch_copies, n_prefetch_waits, n_prefetch_hits;
    int prefetch_thread;                 /* kiln_thread_id of the last prefetch copy, 0 none */
} kiln_model_info;

void kiln_model_get_info(kiln_model *m, kiln_model_info *out);
/* Bytes of the model's copies on dev (dev NULL: all host and device copies). */
uint64_t kiln_model_bytes(kiln_model *m, const kiln_device *dev);

/* One row per open model and device holding its copies, most recently used first;
 * a model with nothing resident gets one row with device "". Returns the number of
 * rows there are (more than max when out was too short). */
typedef struct {
    char model[64];
    char device[16];
    uint64_t bytes;
    int tensors, total;
    int pinned;
    uint64_t last_used;
} kiln_model_usage;
int kiln_model_usage_list(kiln_model_usage *out, int max);

/* Evicts unpinned models' copies on dev (device copies, and host copies when dev
 * is the cpu), least recently used first, until `need` bytes are freed; copies in
 * use by fetch are kept. Returns the bytes given back (copies still referenced
 * elsewhere are dropped but not counted). The allocators' evict hook calls this in
 * every mode but "high". */
size_t kiln_model_evict(kiln_device *dev, size_t need);

#endif
