/* A stand-in libnccl.so.2 for test_nccl: every entry point gpu/nccl.c
 * resolves, with NCCL's ABI, and communicators whose progress the test
 * scripts (fake_nccl_set): "ok" finishes each piece of work after a few
 * polls, "hang" never does, "error" fails one rank with REMOTE_ERROR. It
 * counts aborts and keeps the last config it was given. Built a second time
 * with FAKE_NCCL_NO_BROADCAST, lacking ncclBroadcast. $FAKE_NCCL_VERSION
 * sets what ncclGetVersion reports (default 2.28.9). No GPU, no threads. */
#include <stdlib.h>
#include <string.h>

enum { OK = 0, INVALID_ARGUMENT = 4, REMOTE_ERROR = 6, IN_PROGRESS = 7 };

struct comm {
	int rank, nranks;
	int polls_left; /* of the current piece of work */
};
struct id {
	char internal[128];
};
struct config {
	size_t size;
	unsigned int magic, version;
	int blocking;
};

static char mode[16] = "ok";
static int polls = 3, err_rank = -1, aborts, destroys;
static struct config last_config;

void fake_nccl_set(const char *m, int n, int rank);
void fake_nccl_set(const char *m, int n, int rank)
{
	strncpy(mode, m, sizeof(mode) - 1);
	polls = n;
	err_rank = rank;
	aborts = destroys = 0;
}
int fake_nccl_aborts(void);
int fake_nccl_aborts(void)
{
	return aborts;
}
int fake_nccl_destroys(void);
int fake_nccl_destroys(void)
{
	return destroys;
}
void fake_nccl_last_config(size_t *size, unsigned *magic, unsigned *version, int *blocking);
void fake_nccl_last_config(size_t *size, unsigned *magic, unsigned *version, int *blocking)
{
	*size = last_config.size;
	*magic = last_config.magic;
	*version = last_config.version;
	*blocking = last_config.blocking;
}

int ncclGetVersion(int *v);
int ncclGetVersion(int *v)
{
	const char *e = getenv("FAKE_NCCL_VERSION");
	*v = e ? atoi(e) : 22809;
	return OK;
}
int ncclGetUniqueId(struct id *id);
int ncclGetUniqueId(struct id *id)
{
	memset(id, 0x5a, sizeof(*id));
	return OK;
}
static int start(struct comm *c)
{
	c->polls_left = polls;
	return IN_PROGRESS;
}
int ncclCommInitRankConfig(struct comm **comm, int nranks, struct id id, int rank, struct config *cfg);
int ncclCommInitRankConfig(struct comm **comm, int nranks, struct id id, int rank, struct config *cfg)
{
	if (id.internal[0] != 0x5a || rank < 0 || rank >= nranks)
		return INVALID_ARGUMENT;
	if (cfg)
		memcpy(&last_config, cfg, sizeof(last_config));
	struct comm *c = calloc(1, sizeof(*c));
	if (!c)
		return INVALID_ARGUMENT;
	c->rank = rank;
	c->nranks = nranks;
	*comm = c;
	return start(c);
}
int ncclCommInitRank(struct comm **comm, int nranks, struct id id, int rank);
int ncclCommInitRank(struct comm **comm, int nranks, struct id id, int rank)
{
	return ncclCommInitRankConfig(comm, nranks, id, rank, NULL);
}
int ncclCommAbort(struct comm *c);
int ncclCommAbort(struct comm *c)
{
	aborts++;
	free(c);
	return OK;
}
int ncclCommDestroy(struct comm *c);
int ncclCommDestroy(struct comm *c)
{
	destroys++;
	free(c);
	return OK;
}
int ncclCommFinalize(struct comm *c);
int ncclCommFinalize(struct comm *c)
{
	return start(c);
}
int ncclCommGetAsyncError(struct comm *c, int *err);
int ncclCommGetAsyncError(struct comm *c, int *err)
{
	if (strcmp(mode, "hang") == 0) {
		*err = IN_PROGRESS;
	} else if (c->polls_left > 0) {
		c->polls_left--;
		*err = IN_PROGRESS;
	} else {
		*err = strcmp(mode, "error") == 0 && c->rank == err_rank ? REMOTE_ERROR : OK;
	}
	return OK;
}
int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, struct comm *c, void *st);
int ncclAllReduce(const void *s, void *r, size_t n, int t, int op, struct comm *c, void *st)
{
	return start(c);
}
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, struct comm *c, void *st);
int ncclReduceScatter(const void *s, void *r, size_t n, int t, int op, struct comm *c, void *st)
{
	return start(c);
}
int ncclAllGather(const void *s, void *r, size_t n, int t, struct comm *c, void *st);
int ncclAllGather(const void *s, void *r, size_t n, int t, struct comm *c, void *st)
{
	return start(c);
}
int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root, struct comm *c, void *st);
int ncclReduce(const void *s, void *r, size_t n, int t, int op, int root, struct comm *c, void *st)
{
	return start(c);
}
#ifndef FAKE_NCCL_NO_BROADCAST
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, struct comm *c, void *st);
int ncclBroadcast(const void *s, void *r, size_t n, int t, int root, struct comm *c, void *st)
{
	return start(c);
}
#endif
int ncclGroupStart(void);
int ncclGroupStart(void)
{
	return OK;
}
int ncclGroupEnd(void);
int ncclGroupEnd(void)
{
	return OK;
}
const char *ncclGetErrorString(int r);
const char *ncclGetErrorString(int r)
{
	return r == REMOTE_ERROR ? "remote process exited or there was a network error"
				 : "fake error";
}
const char *ncclGetLastError(struct comm *c);
const char *ncclGetLastError(struct comm *c)
{
	return "fake: rank failed on purpose";
}
