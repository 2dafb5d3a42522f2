/* td_err: strings and conversions. Not a logger. */
#include "proto/err.h"

#include <errno.h>
#include <stdio.h>

const char *td_strerror(td_err e)
{
	switch (e) {
	case TD_OK:
		return "success";
#define TD_ERR_STR_(name, msg) \
	case TD_E##name:       \
		return msg;
		TD_ERR_LIST(TD_ERR_STR_)
#undef TD_ERR_STR_
	default:
		return "unknown error";
	}
}

const char *td_errname(td_err e)
{
	switch (e) {
	case TD_OK:
		return "TD_OK";
#define TD_ERR_NAME_(name, msg) \
	case TD_E##name:        \
		return "TD_E" #name;
		TD_ERR_LIST(TD_ERR_NAME_)
#undef TD_ERR_NAME_
	default:
		return "TD_E?";
	}
}

td_err td_vfail(struct td_errbuf *eb, td_err code, const char *fmt, va_list ap)
{
	if (eb)
		vsnprintf(eb->msg, sizeof(eb->msg), fmt, ap);
	return code;
}

td_err td_fail(struct td_errbuf *eb, td_err code, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	td_vfail(eb, code, fmt, ap);
	va_end(ap);
	return code;
}

td_err td_from_errno(int errnum)
{
	switch (errnum) {
	case 0:
		return TD_OK;
	case ENOENT:
	case ENOTDIR:
		return TD_ENOENT;
	case EACCES:
	case EPERM:
	case EROFS:
		return TD_EPERM;
	case ENOMEM:
		return TD_ENOMEM;
	case EINVAL:
		return TD_EINVAL;
	case EBUSY:
		return TD_EBUSY;
	case ERANGE:
	case EOVERFLOW:
		return TD_ERANGE;
	default:
		return TD_EIO;
	}
}
