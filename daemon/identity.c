/* Caller identity from the socket, admin membership, per-thread filesystem
 * credentials (daemon/identity.h). */
#include "daemon/identity.h"

#include <errno.h>
#include <grp.h>
#include <nng/nng.h>
#include <pthread.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fsuid.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "proto/log.h"

td_err dmn_peer_of(struct nng_msg *msg, struct dmn_peer *out, struct td_errbuf *eb)
{
	nng_pipe p = nng_msg_get_pipe(msg);
	uint64_t uid, gid, pid = 0;
	int rv = nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_UID, &uid);
	if (rv == 0)
		rv = nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_GID, &gid);
	if (rv != 0)
		return td_fail(eb, TD_EPERM, "the connection carries no peer credentials (%s)",
			       nng_strerror(rv));
	if (nng_pipe_get_uint64(p, NNG_OPT_IPC_PEER_PID, &pid) != 0)
		pid = 0;
	out->uid = (uid_t)uid;
	out->gid = (gid_t)gid;
	out->pid = (pid_t)pid;
	return TD_OK;
}

/* --- admin membership, cached per uid (loop thread only) --- */

#define ADMIN_CACHE 64
#define ADMIN_TTL_S 60

static struct {
	uid_t uid;
	gid_t gid;
	bool admin;
	time_t at;
	char group[64];
} admin_cache[ADMIN_CACHE];
static unsigned admin_next;

void dmn_identity_flush(void)
{
	memset(admin_cache, 0, sizeof(admin_cache));
}

static bool lookup_admin(uid_t uid, gid_t gid, const char *group)
{
	char buf[16384];
	struct group gr, *grp = NULL;
	if (getgrnam_r(group, &gr, buf, sizeof(buf), &grp) != 0 || !grp)
		return false;
	gid_t agid = grp->gr_gid;
	if (gid == agid)
		return true;
	struct passwd pw, *pwp = NULL;
	char pbuf[16384];
	if (getpwuid_r(uid, &pw, pbuf, sizeof(pbuf), &pwp) != 0 || !pwp)
		return false;
	gid_t groups[256];
	int n = 256;
	if (getgrouplist(pwp->pw_name, pwp->pw_gid, groups, &n) < 0)
		n = 256; /* truncated: the first 256 are checked */
	for (int i = 0; i < n; i++)
		if (groups[i] == agid)
			return true;
	return false;
}

bool dmn_is_admin(uid_t uid, gid_t gid, const char *admin_group)
{
	if (uid == 0)
		return true;
	if (!admin_group || !*admin_group)
		return false;
	time_t now = time(NULL);
	for (unsigned i = 0; i < ADMIN_CACHE; i++) {
		if (admin_cache[i].at && admin_cache[i].uid == uid && admin_cache[i].gid == gid &&
		    now - admin_cache[i].at < ADMIN_TTL_S &&
		    strcmp(admin_cache[i].group, admin_group) == 0)
			return admin_cache[i].admin;
	}
	bool admin = lookup_admin(uid, gid, admin_group);
	unsigned k = admin_next++ % ADMIN_CACHE;
	admin_cache[k].uid = uid;
	admin_cache[k].gid = gid;
	admin_cache[k].admin = admin;
	admin_cache[k].at = now;
	snprintf(admin_cache[k].group, sizeof(admin_cache[k].group), "%s", admin_group);
	return admin;
}

bool dmn_pid_owned_by(pid_t pid, uid_t uid)
{
	if (pid <= 0)
		return false;
	char path[64], line[256];
	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	FILE *f = fopen(path, "re");
	if (!f)
		return false;
	bool owned = false;
	while (fgets(line, sizeof(line), f)) {
		unsigned long ruid;
		if (sscanf(line, "Uid: %lu", &ruid) == 1) {
			owned = (uid_t)ruid == uid;
			break;
		}
	}
	fclose(f);
	return owned;
}

/* --- per-thread filesystem credentials --- */

static pthread_once_t own_once = PTHREAD_ONCE_INIT;
static gid_t own_groups[256];
static int own_ngroups;

static void save_own_groups(void)
{
	int n = getgroups(256, own_groups);
	own_ngroups = n < 0 ? 0 : n;
}

td_err dmn_fscreds_of(struct dmn_fscreds *c, uid_t uid, gid_t gid, struct td_errbuf *eb)
{
	pthread_once(&own_once, save_own_groups);
	memset(c, 0, sizeof(*c));
	c->uid = uid;
	c->gid = gid;
	c->groups[0] = gid;
	c->ngroups = 1;
	struct passwd pw, *pwp = NULL;
	char buf[16384];
	int rv = getpwuid_r(uid, &pw, buf, sizeof(buf), &pwp);
	if (rv != 0)
		return td_fail(eb, TD_EIO, "uid %u: user lookup failed: %s", (unsigned)uid, strerror(rv));
	if (!pwp)
		return TD_OK; /* no passwd entry: the primary group alone */
	int n = (int)(sizeof(c->groups) / sizeof(c->groups[0]));
	if (getgrouplist(pwp->pw_name, gid, c->groups, &n) < 0) {
		td_warn("TD-ID-GROUPS", "user %s is in more than %d groups; using the first %d",
			pwp->pw_name, n, (int)(sizeof(c->groups) / sizeof(c->groups[0])));
		n = (int)(sizeof(c->groups) / sizeof(c->groups[0]));
	}
	c->ngroups = n;
	return TD_OK;
}

bool dmn_fscreds_needed(const struct dmn_fscreds *c)
{
	return geteuid() == 0 && c->uid != 0;
}

td_err dmn_fscreds_enter(const struct dmn_fscreds *c, struct td_errbuf *eb)
{
	if (!dmn_fscreds_needed(c))
		return TD_OK;
	pthread_once(&own_once, save_own_groups);
	/* The raw syscall: glibc's setgroups() applies to every thread. */
	if (syscall(SYS_setgroups, (size_t)c->ngroups, c->groups) != 0)
		return td_fail(eb, TD_EPERM, "cannot take the groups of uid %u: %s", (unsigned)c->uid,
			       strerror(errno));
	setfsgid(c->gid);
	setfsuid(c->uid);
	/* setfsuid reports the previous value; -1 changes nothing and reads it. */
	if ((uid_t)setfsuid((uid_t)-1) != c->uid || (gid_t)setfsgid((gid_t)-1) != c->gid) {
		dmn_fscreds_leave(c);
		return td_fail(eb, TD_EPERM, "cannot take the file identity of uid %u gid %u",
			       (unsigned)c->uid, (unsigned)c->gid);
	}
	return TD_OK;
}

void dmn_fscreds_leave(const struct dmn_fscreds *c)
{
	if (!dmn_fscreds_needed(c))
		return;
	setfsuid(geteuid());
	setfsgid(getegid());
	if (syscall(SYS_setgroups, (size_t)own_ngroups, own_groups) != 0)
		td_err_log("TD-ID-RESTORE", "cannot restore the daemon's groups: %s", strerror(errno));
}
