/* backends.h - the list of the backends this build links, handed to the runtime by
 * the initialisation code: luaopen_kiln (every Lua state and kiln_open), a host's
 * first device query (kiln_device_name_at) and the test programs' harness call it
 * before the first device is used. The runtime (device.h) never calls up into
 * kernels/: it keeps what it is handed. */
#ifndef KILN_BACKENDS_H
#define KILN_BACKENDS_H

/* Hands every backend's table to kiln_backend_register, in the order the runtime
 * meets them (cpu first, meta last). Any thread, any number of times: a backend
 * already registered is kept once. */
void kiln_backends_register_all(void);

#endif
