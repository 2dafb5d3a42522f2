/* Who is asking, and acting as them (contract 8 of DESIGN.md).
 *
 * A caller's uid and gid come from the socket (NNG_OPT_IPC_PEER_UID/GID/PID on
 * the pipe a request arrived on), never from a message. Root and members of
 * the admin group may act on every job; everyone else on their own.
 *
 * As root the daemon reads a job's inputs and writes its outputs with the
 * submitter's filesystem credentials: dmn_fscreds_enter() switches the CALLING
 * THREAD's fsuid, fsgid and supplementary groups (raw syscalls: glibc's
 * setgroups() would change every thread). While switched the thread has none
 * of root's file capabilities (the kernel drops CAP_DAC_OVERRIDE & co. from a
 * thread whose fsuid is not 0), so it cannot open a file that user could not.
 * dmn_fscreds_leave() switches back. Not a sandbox for code: the process keeps
 * its uid; only file access is the user's. */
#ifndef DAEMON_IDENTITY_H
#define DAEMON_IDENTITY_H

#include <stdbool.h>
#include <sys/types.h>

#include "proto/err.h"

struct dmn_peer {
	uid_t uid;
	gid_t gid;
	pid_t pid; /* 0 if the transport did not say */
};

struct nng_msg;

/* The sender of msg (nng_msg_get_pipe + the pipe's options). TD_EPERM when
 * the pipe does not carry credentials (the caller must refuse the request). */
td_err dmn_peer_of(struct nng_msg *msg, struct dmn_peer *out, struct td_errbuf *eb);

/* Whether uid (with primary gid) is root or in group admin_group (by name; ""
 * means no group). Looks the group and the user's groups up through NSS and
 * keeps the answer for a minute per uid. Called on the loop thread only. */
bool dmn_is_admin(uid_t uid, gid_t gid, const char *admin_group);

/* Forgets cached group answers (SIGHUP: the group or its members may have
 * changed). */
void dmn_identity_flush(void);

/* Whether process pid belongs to uid (its real uid, from /proc). */
bool dmn_pid_owned_by(pid_t pid, uid_t uid);

/* A user's filesystem identity. */
struct dmn_fscreds {
	uid_t uid;
	gid_t gid;
	int ngroups;
	gid_t groups[64];
};

/* Fills c for uid/gid with the user's supplementary groups (getgrouplist). A
 * uid without a passwd entry gets gid alone. Blocks on NSS. */
td_err dmn_fscreds_of(struct dmn_fscreds *c, uid_t uid, gid_t gid, struct td_errbuf *eb);

/* Whether switching is needed: the daemon runs as root and c is not root. */
bool dmn_fscreds_needed(const struct dmn_fscreds *c);

/* Switches this thread to c (no-op when !dmn_fscreds_needed). TD_EPERM if the
 * kernel refused (the thread is then back to the daemon's credentials). */
td_err dmn_fscreds_enter(const struct dmn_fscreds *c, struct td_errbuf *eb);

/* Switches this thread back to the daemon's own credentials. */
void dmn_fscreds_leave(const struct dmn_fscreds *c);

#endif
