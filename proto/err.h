/* One error enum for all of traind (contract 9 of DESIGN.md).
 *
 * Every function that can fail returns a td_err; TD_OK is 0. Codes coming from
 * other libraries (errno, sqlite, nng, CUresult, cublasStatus_t) are turned into
 * one of these at the boundary. The human-readable detail (which file, which
 * field, which line) travels in a struct td_errbuf owned by the caller.
 *
 * This is not a logger: see proto/log.h. */
#ifndef PROTO_ERR_H
#define PROTO_ERR_H

#include <stdarg.h>
#include <stddef.h>

/* X(NAME, "message") — the name is TD_E<NAME>; codes are negative, in order. */
#define TD_ERR_LIST(X)                                                        \
	X(INVAL, "invalid argument")                                          \
	X(NOMEM, "out of memory")                                             \
	X(IO, "input/output error")                                           \
	X(NOENT, "no such file or directory")                                 \
	X(PERM, "permission denied")                                          \
	X(FORMAT, "malformed input")                                          \
	X(UNSUPPORTED, "unsupported")                                         \
	X(RANGE, "value out of range")                                        \
	X(MISMATCH, "inconsistent input")                                     \
	X(NUMERIC, "numerical failure (NaN or Inf)")                          \
	X(BUSY, "resource busy")                                              \
	X(STATE, "invalid state")                                             \
	X(DEVICE, "device error")                                             \
	X(INTERNAL, "internal error")                                         \
	/* A sticky CUDA error (illegal address, launch failure...): the       \
	 * device's primary context is corrupt for the whole process, every    \
	 * job on that device fails, and the context must be reset. */         \
	X(DEVICE_LOST, "device context lost")                                 \
	/* A job across daemons lost one of them (its process, its host or     \
	 * the connection): no rank's fault; the job is requeued. */           \
	X(PEER_LOST, "a daemon of the job was lost")

typedef enum td_err {
	TD_OK = 0,
#define TD_ERR_ENUM_(name, msg) TD_E##name,
	TD_ERR_FIRST_ = -1000,
	TD_ERR_LIST(TD_ERR_ENUM_)
#undef TD_ERR_ENUM_
	TD_ERR_END_
} td_err;

/* Static string for a code ("invalid argument"); never NULL. */
const char *td_strerror(td_err e);
/* Static name for a code ("TD_EINVAL"); never NULL. */
const char *td_errname(td_err e);

/* Where the detail of an error goes. The callee writes msg only when it fails. */
struct td_errbuf {
	char msg[1024];
};

/* Formats the detail into eb (if eb is non-NULL) and returns code, so that a
 * failing path reads `return td_fail(eb, TD_EFORMAT, "%s: bad header", path);` */
td_err td_fail(struct td_errbuf *eb, td_err code, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
td_err td_vfail(struct td_errbuf *eb, td_err code, const char *fmt, va_list ap)
	__attribute__((format(printf, 3, 0)));

/* Maps an errno value to a td_err. */
td_err td_from_errno(int errnum);

#endif
