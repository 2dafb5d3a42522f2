/* What every short-lived REQ client of a traind socket sets (trainctl, the
 * daemons' calls to each other, the tests' raw client). Header-only: the
 * proto library itself does not link nng. */
#ifndef TD_PROTO_RPC_NNG_H
#define TD_PROTO_RPC_NNG_H

#include <nng/nng.h>
#include <nng/protocol/reqrep0/req.h>

/* One request, one connection. A request is never sent twice (a resent
 * submit would queue the job twice), and the connection is never made again
 * behind the call's back: nng 1.5's close can hang for good where the dialer
 * is making a pipe at that moment (nng #1498), and a lost connection fails
 * the call anyway. A redial an hour away is none in a client's life. */
static inline int rpc_req_once(nng_socket s)
{
	int rv = nng_socket_set_ms(s, NNG_OPT_REQ_RESENDTIME, NNG_DURATION_INFINITE);
	if (rv == 0)
		rv = nng_socket_set_ms(s, NNG_OPT_RECONNMINT, 3600 * 1000);
	if (rv == 0)
		rv = nng_socket_set_ms(s, NNG_OPT_RECONNMAXT, 3600 * 1000);
	return rv;
}

#endif
