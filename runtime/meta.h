/* meta.h - the shape-only device `meta`: tensors with shapes, dtypes and accounted
 * bytes but no data, allocated through a caching allocator of their own over address
 * space that is reserved, readable as zeros and never written. A dry run makes meta
 * model another device (its allocator's grain, cache limit and budget, its backend's
 * optional entries) and answer to that device's name, so a script takes the same
 * allocation decisions as on the real device and its peak can be read without
 * arithmetic and without reading weight files. */
#ifndef KILN_META_H
#define KILN_META_H

#include "device.h"

/* The meta device is kiln_device_meta() (device.h). Outside a dry run it models the
 * CPU backend's decisions with sim's allocator settings and no budget. */
int kiln_device_is_meta(const kiln_device *d);
/* meta's raw memory (for device.c, which creates the device). */
kiln_raw_memory kiln_meta_raw_memory(void);

/* Whether d's memory is host memory that the runtime may read and write directly
 * (cpu, sim): for meta, the answer of the device it models, so host-memory paths
 * are taken (without their arithmetic) exactly where the modelled device takes them. */
int kiln_device_host_memory(const kiln_device *d);

/* Starts a dry run: meta models target (not meta itself) with that budget (0: none),
 * empty, its peak reset, and kiln_device_get(target's name) returns meta until
 * kiln_meta_end. One dry run at a time (KILN_ERR_ARG when one is active). */
kiln_status kiln_meta_begin(kiln_device *target, uint64_t budget);
/* Ends it: the end hook runs (model.c's drops every model copy made during the dry
 * run: on meta, and host copies that were never filled), meta's cache is emptied, its
 * name and model restored. Returns the bytes still allocated on meta by tensors that
 * outlive the run. */
uint64_t kiln_meta_end(void);
/* The end hook: called by kiln_meta_end (outside meta's lock) with the meta device when
 * a dry run was active, before meta's cache is emptied. The layers above meta register
 * what they keep of a dry run here (model.c its model copies, at its initialisation)
 * instead of meta calling up into them. One hook; a later call replaces it; NULL none. */
typedef void (*kiln_meta_end_fn)(kiln_device *meta);
void kiln_meta_set_end_hook(kiln_meta_end_fn fn);
/* The device being modelled during a dry run, else NULL. */
kiln_device *kiln_meta_target(void);
/* The backend table of the modelled device (the CPU backend outside a dry run): meta's
 * kernels mirror the temporaries that backend allocates. */
const kiln_backend *kiln_meta_modelled_backend(void);

/* Watermarks for a dry run's stages, kept apart from the allocator's peak (which the
 * script may reset itself): kiln_meta_note is called after every storage allocation
 * on meta; kiln_meta_mark returns the highest allocated / reserved bytes since the
 * previous mark (or kiln_meta_begin) and starts the next interval from now. */
void kiln_meta_note(kiln_device *meta);
void kiln_meta_mark(uint64_t *peak_allocated, uint64_t *peak_reserved);

/* Kernel scratch the modelled backend takes outside its device's allocator (the CPU's
 * host scratch): meta's kernels note what one op would hold at most; the peak over
 * the dry run (since kiln_meta_begin) is the prediction for the real run's
 * kiln_mem_stats.workspace_peak. */
void kiln_meta_note_scratch(uint64_t bytes);
uint64_t kiln_meta_scratch_peak(void);

/* Host memory that reads as zeros and costs nothing until written (a model's host
 * copy made during a dry run, which must not read the weight file): a cpu storage
 * of nbytes released with munmap. NULL when the address space is exhausted. */
kiln_storage *kiln_meta_host_storage(size_t nbytes);
int kiln_meta_is_host_storage(const kiln_storage *s);

#endif
