/* The job spec: load (binary, or text through protoc), decode, default,
 * validate, encode, print. See proto/jobspec.h for the contracts.
 *
 * Not here: the RPC envelope, and any check that needs the file system beyond
 * reading the spec file itself.
 *
 * Static defaults ([default = ...] in traind.proto) are applied by walking the
 * generated descriptors, so a field added to the .proto with a default needs no
 * code here; only defaults that depend on other fields are written out. */
#include "proto/jobspec.h"

#include "config.h"

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

/* protoc gets this long to turn a text spec into bytes; it needs milliseconds. */
#define PROTOC_TIMEOUT_MS 30000
/* How much of protoc's stderr is kept for the error message. */
#define PROTOC_STDERR_KEEP 2048

/* ------------------------------------------------------------------------ */
/* Names */

static const char *const method_names[] = {
	[TRAIND__METHOD__METHOD_UNSPECIFIED] = "full",
	[TRAIND__METHOD__METHOD_FULL] = "full",
	[TRAIND__METHOD__METHOD_LORA] = "lora",
	[TRAIND__METHOD__METHOD_QLORA] = "qlora",
	[TRAIND__METHOD__METHOD_DISTILL] = "distill",
	[TRAIND__METHOD__METHOD_CLASSIFY] = "classify",
};

const char *rpc_method_name(Traind__Method m)
{
	if ((unsigned)m < sizeof(method_names) / sizeof(method_names[0]) && method_names[m])
		return method_names[m];
	return "unknown";
}

td_err rpc_method_from_name(const char *name, Traind__Method *out)
{
	if (!name)
		return TD_EINVAL;
	for (unsigned i = TRAIND__METHOD__METHOD_FULL; i < sizeof(method_names) / sizeof(method_names[0]); i++) {
		if (strcasecmp(name, method_names[i]) == 0) {
			*out = (Traind__Method)i;
			return TD_OK;
		}
	}
	return TD_EINVAL;
}

/* Lower-case name of an enum value ("METHOD_LORA" -> "lora") for print; the
 * generated descriptors carry the full names. */
static const char *enum_short(const ProtobufCEnumDescriptor *d, int v, char *buf, size_t cap)
{
	const ProtobufCEnumValue *ev = protobuf_c_enum_descriptor_get_value(d, v);
	if (!ev) {
		snprintf(buf, cap, "unknown (%d)", v);
		return buf;
	}
	/* The value names carry the enum's name as a prefix: "SCHEDULE_COSINE". */
	const char *n = ev->name;
	const char *us = strchr(n, '_');
	if (d == &traind__data_format__descriptor)
		us = strchr(us + 1, '_'); /* DATA_FORMAT_ */
	n = us ? us + 1 : n;
	size_t i = 0;
	for (; n[i] && i + 1 < cap; i++)
		buf[i] = (char)(n[i] >= 'A' && n[i] <= 'Z' ? n[i] - 'A' + 'a' : n[i]);
	buf[i] = '\0';
	return buf;
}

static bool enum_known(const ProtobufCEnumDescriptor *d, int v)
{
	return protobuf_c_enum_descriptor_get_value(d, v) != NULL;
}

/* ------------------------------------------------------------------------ */
/* New, free, decode, encode, copy */

Traind__JobSpec *rpc_jobspec_new(void)
{
	Traind__JobSpec *s = malloc(sizeof(*s));
	if (s)
		traind__job_spec__init(s);
	return s;
}

void rpc_jobspec_free(Traind__JobSpec *s)
{
	if (s)
		protobuf_c_message_free_unpacked(&s->base, NULL);
}

static td_err decode_named(Traind__JobSpec **out, const uint8_t *buf, size_t len, const char *what,
			   struct td_errbuf *eb)
{
	static const uint8_t empty[1];
	if (!out || (!buf && len))
		return td_fail(eb, TD_EINVAL, "%s: no buffer", what);
	if (len > RPC_JOBSPEC_MAX_BYTES)
		return td_fail(eb, TD_ERANGE, "%s: %zu bytes, more than the %u a job spec may have", what, len,
			       RPC_JOBSPEC_MAX_BYTES);
	/* protobuf-c returns NULL for malformed input and for a failed allocation
	 * alike; at this size the first is what happened. */
	Traind__JobSpec *s = traind__job_spec__unpack(NULL, len, buf ? buf : empty);
	if (!s)
		return td_fail(eb, TD_EFORMAT, "%s: not a valid traind.JobSpec protobuf (%zu bytes)", what, len);
	/* protobuf-c keeps unknown fields as they came and accepts a tag written
	 * in more bytes than it needs (field 0 as 0x80 0x00), which it refuses
	 * once written back canonically: such a spec would load, then fail when
	 * trainctl sends it or the daemon copies it. Refused here, as
	 * rpc_request_decode refuses such a request (fuzz_jobspec found it). */
	uint8_t *again = NULL;
	size_t n = 0;
	td_err e = rpc_jobspec_encode(s, &again, &n);
	Traind__JobSpec *t = e == TD_OK ? traind__job_spec__unpack(NULL, n, again) : NULL;
	free(again);
	rpc_jobspec_free(t);
	if (!t) {
		rpc_jobspec_free(s);
		return e != TD_OK ? td_fail(eb, e, "%s: out of memory", what)
				  : td_fail(eb, TD_EFORMAT,
					    "%s: malformed field tags (%zu bytes; an unknown field with an invalid number?)",
					    what, len);
	}
	*out = s;
	return TD_OK;
}

td_err rpc_jobspec_decode(Traind__JobSpec **out, const uint8_t *buf, size_t len, struct td_errbuf *eb)
{
	return decode_named(out, buf, len, "job spec", eb);
}

td_err rpc_jobspec_encode(const Traind__JobSpec *s, uint8_t **buf, size_t *len)
{
	if (!s || !buf || !len)
		return TD_EINVAL;
	size_t n = traind__job_spec__get_packed_size(s);
	uint8_t *b = malloc(n ? n : 1);
	if (!b)
		return TD_ENOMEM;
	size_t w = traind__job_spec__pack(s, b);
	if (w != n) {
		free(b);
		return TD_EINTERNAL;
	}
	*buf = b;
	*len = n;
	return TD_OK;
}

td_err rpc_jobspec_copy(Traind__JobSpec **out, const Traind__JobSpec *s)
{
	if (!out || !s)
		return TD_EINVAL;
	uint8_t *b;
	size_t n;
	td_err e = rpc_jobspec_encode(s, &b, &n);
	if (e)
		return e;
	Traind__JobSpec *c = traind__job_spec__unpack(NULL, n, b);
	free(b);
	if (!c)
		return TD_ENOMEM; /* our own bytes: only an allocation can fail */
	*out = c;
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Loading a file */

static const char *errno_str(int e, char *buf, size_t cap)
{
	return strerror_r(e, buf, cap); /* GNU: returns the string */
}

static bool has_suffix(const char *s, const char *suf)
{
	size_t n = strlen(s), m = strlen(suf);
	return n >= m && strcasecmp(s + n - m, suf) == 0;
}

/* Reads a regular file of at most RPC_JOBSPEC_MAX_BYTES. */
static td_err read_bounded(const char *path, uint8_t **out, size_t *out_len, struct td_errbuf *eb)
{
	char eb_s[128];
	/* O_NONBLOCK: opening a FIFO must not hang; it is then refused below. */
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0) {
		int e = errno;
		return td_fail(eb, td_from_errno(e), "%s: %s", path, errno_str(e, eb_s, sizeof(eb_s)));
	}
	struct stat st;
	if (fstat(fd, &st) != 0) {
		int e = errno;
		close(fd);
		return td_fail(eb, td_from_errno(e), "%s: %s", path, errno_str(e, eb_s, sizeof(eb_s)));
	}
	if (!S_ISREG(st.st_mode)) {
		close(fd);
		return td_fail(eb, TD_EINVAL, "%s: not a regular file", path);
	}
	if (st.st_size > (off_t)RPC_JOBSPEC_MAX_BYTES) {
		close(fd);
		return td_fail(eb, TD_ERANGE, "%s: %lld bytes, more than the %u a job spec may have", path,
			       (long long)st.st_size, RPC_JOBSPEC_MAX_BYTES);
	}
	/* One byte more than the limit, to notice a file that grew since fstat. */
	size_t cap = (size_t)st.st_size + 1, len = 0;
	uint8_t *buf = malloc(cap);
	if (!buf) {
		close(fd);
		return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
	}
	for (;;) {
		if (len == cap) {
			if (cap > RPC_JOBSPEC_MAX_BYTES) {
				free(buf);
				close(fd);
				return td_fail(eb, TD_ERANGE, "%s: more than the %u bytes a job spec may have",
					       path, RPC_JOBSPEC_MAX_BYTES);
			}
			size_t ncap = cap * 2 > RPC_JOBSPEC_MAX_BYTES + 1 ? RPC_JOBSPEC_MAX_BYTES + 1 : cap * 2;
			uint8_t *nb = realloc(buf, ncap);
			if (!nb) {
				free(buf);
				close(fd);
				return td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
			}
			buf = nb;
			cap = ncap;
		}
		ssize_t r = read(fd, buf + len, cap - len);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			int e = errno;
			free(buf);
			close(fd);
			return td_fail(eb, td_from_errno(e), "%s: %s", path, errno_str(e, eb_s, sizeof(eb_s)));
		}
		if (r == 0)
			break;
		len += (size_t)r;
	}
	close(fd);
	*out = buf;
	*out_len = len;
	return TD_OK;
}

/* The protoc to run: $TD_PROTOC, else TD_PROTOC; a bare name is looked up in
 * $PATH here, before fork, so the child only has to execv(). NULL if none. */
static char *find_protoc(void)
{
	const char *p = getenv("TD_PROTOC");
	if (!p || !*p)
		p = TD_PROTOC;
	if (strchr(p, '/'))
		return access(p, X_OK) == 0 ? strdup(p) : NULL;
	const char *path = getenv("PATH");
	if (!path || !*path)
		path = "/usr/local/bin:/usr/bin:/bin";
	while (*path) {
		size_t n = strcspn(path, ":");
		char *cand;
		if (asprintf(&cand, "%.*s/%s", (int)n, n ? path : ".", p) < 0)
			return NULL;
		if (access(cand, X_OK) == 0)
			return cand;
		free(cand);
		path += n;
		if (*path == ':')
			path++;
	}
	return NULL;
}

/* The .proto that protoc reads; see rpc_jobspec_load. */
static const char *proto_file(void)
{
	const char *p = getenv("TD_PROTO_PATH");
	if (p && *p)
		return p;
	if (access(TD_PROTO_INSTALL_PATH, R_OK) == 0)
		return TD_PROTO_INSTALL_PATH;
	return TD_PROTO_SRC_PATH;
}

/* Moves fd out of 0..2, so that the child's dup2()s onto 0..2 cannot clobber
 * one of its own sources (a daemon may run with stdin closed). */
static int fd_above_stdio(int fd)
{
	if (fd < 0 || fd > 2)
		return fd;
	int n = fcntl(fd, F_DUPFD_CLOEXEC, 3);
	int e = errno;
	close(fd);
	errno = e;
	return n;
}

static void close_fd(int *fd)
{
	if (*fd >= 0) {
		close(*fd);
		*fd = -1;
	}
}

/* Child side of run_protoc: async-signal-safe calls only. */
static _Noreturn void protoc_child(char *const argv[], int in, int out, int err, int report)
{
	sigset_t none;
	sigemptyset(&none);
	sigprocmask(SIG_SETMASK, &none, NULL);
	struct sigaction dfl = { .sa_handler = SIG_DFL };
	sigaction(SIGPIPE, &dfl, NULL);
	if (dup2(in, 0) < 0 || dup2(out, 1) < 0 || dup2(err, 2) < 0)
		goto fail;
	/* Whatever else the process has open stays out of protoc. */
	close_range(3, ~0u, CLOSE_RANGE_CLOEXEC);
	execv(argv[0], argv);
fail:;
	int e = errno;
	ssize_t w = write(report, &e, sizeof(e));
	(void)w;
	_exit(127);
}

struct protoc_run {
	uint8_t *out; /* protoc's stdout */
	size_t out_len;
	bool out_overflow; /* more than RPC_JOBSPEC_MAX_BYTES, or out_nomem */
	bool out_nomem;
	char err[PROTOC_STDERR_KEEP + 1]; /* the start of protoc's stderr, NUL-terminated */
	size_t err_len;
	int status; /* from waitpid; -1 if unknown */
	bool timed_out;
};

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Runs argv with `in` on its stdin and collects stdout and stderr, all three
 * at once (poll) so that neither side waits on a full pipe. */
static td_err run_protoc(char *const argv[], const uint8_t *in, size_t in_len, struct protoc_run *r,
			 struct td_errbuf *eb)
{
	char es[128];
	int sv[2] = { -1, -1 }, po[2] = { -1, -1 }, pe[2] = { -1, -1 }, px[2] = { -1, -1 };
	td_err rc = TD_OK;
	memset(r, 0, sizeof(*r));
	r->status = -1;

	/* stdin is a socket so that send(MSG_NOSIGNAL) can write it: if protoc
	 * exits before reading everything, we get EPIPE, not SIGPIPE. */
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0 || pipe2(po, O_CLOEXEC) != 0 ||
	    pipe2(pe, O_CLOEXEC) != 0 || pipe2(px, O_CLOEXEC) != 0) {
		int e = errno;
		rc = td_fail(eb, td_from_errno(e), "cannot run protoc: %s", errno_str(e, es, sizeof(es)));
		goto out;
	}
	int *fds[] = { &sv[0], &sv[1], &po[0], &po[1], &pe[0], &pe[1], &px[0], &px[1] };
	for (size_t i = 0; i < sizeof(fds) / sizeof(fds[0]); i++) {
		*fds[i] = fd_above_stdio(*fds[i]);
		if (*fds[i] < 0) {
			int e = errno;
			rc = td_fail(eb, td_from_errno(e), "cannot run protoc: %s", errno_str(e, es, sizeof(es)));
			goto out;
		}
	}

	pid_t pid = fork();
	if (pid < 0) {
		int e = errno;
		rc = td_fail(eb, td_from_errno(e), "cannot run protoc: fork: %s", errno_str(e, es, sizeof(es)));
		goto out;
	}
	if (pid == 0)
		protoc_child(argv, sv[1], po[1], pe[1], px[1]);
	close_fd(&sv[1]);
	close_fd(&po[1]);
	close_fd(&pe[1]);
	close_fd(&px[1]);

	/* EOF on px: exec succeeded (the fd was close-on-exec); an int: it failed. */
	int child_errno = 0;
	ssize_t got;
	do
		got = read(px[0], &child_errno, sizeof(child_errno));
	while (got < 0 && errno == EINTR);
	if (got == (ssize_t)sizeof(child_errno)) {
		while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
			;
		rc = td_fail(eb, TD_EUNSUPPORTED, "cannot run %s: %s", argv[0],
			     errno_str(child_errno, es, sizeof(es)));
		goto out;
	}

	fcntl(sv[0], F_SETFL, O_NONBLOCK);
	fcntl(po[0], F_SETFL, O_NONBLOCK);
	fcntl(pe[0], F_SETFL, O_NONBLOCK);
	size_t in_off = 0, out_cap = 0;
	if (in_len == 0)
		close_fd(&sv[0]);
	long long deadline = now_ms() + PROTOC_TIMEOUT_MS;
	while (po[0] >= 0 || pe[0] >= 0) {
		struct pollfd p[3];
		int n = 0, i_in = -1, i_out = -1, i_err = -1;
		if (sv[0] >= 0) {
			i_in = n;
			p[n++] = (struct pollfd){ .fd = sv[0], .events = POLLOUT };
		}
		if (po[0] >= 0) {
			i_out = n;
			p[n++] = (struct pollfd){ .fd = po[0], .events = POLLIN };
		}
		if (pe[0] >= 0) {
			i_err = n;
			p[n++] = (struct pollfd){ .fd = pe[0], .events = POLLIN };
		}
		long long left = deadline - now_ms();
		int k = left > 0 ? poll(p, (nfds_t)n, (int)left) : 0;
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0) {
			int e = errno;
			kill(pid, SIGKILL);
			rc = td_fail(eb, TD_EIO, "protoc: poll: %s", errno_str(e, es, sizeof(es)));
			break;
		}
		if (k == 0) {
			kill(pid, SIGKILL);
			r->timed_out = true;
			break;
		}
		if (i_in >= 0 && p[i_in].revents) {
			size_t chunk = in_len - in_off < 65536 ? in_len - in_off : 65536;
			ssize_t w = send(sv[0], in + in_off, chunk, MSG_NOSIGNAL);
			if (w > 0)
				in_off += (size_t)w;
			if ((w < 0 && errno != EAGAIN && errno != EINTR) || in_off == in_len)
				close_fd(&sv[0]); /* done, or protoc stopped reading */
		}
		if (i_out >= 0 && p[i_out].revents) {
			/* Up to one byte over the limit is kept, to tell "over" from "at". */
			if (out_cap == r->out_len && !r->out_overflow) {
				size_t ncap = out_cap ? out_cap * 2 : 8192;
				if (ncap > RPC_JOBSPEC_MAX_BYTES + 1)
					ncap = RPC_JOBSPEC_MAX_BYTES + 1;
				uint8_t *nb = ncap > out_cap ? realloc(r->out, ncap) : NULL;
				if (nb) {
					r->out = nb;
					out_cap = ncap;
				} else {
					r->out_nomem = ncap > out_cap;
					r->out_overflow = true; /* drained and dropped from now on */
				}
			}
			uint8_t sink[4096];
			bool keep = !r->out_overflow;
			ssize_t g = keep ? read(po[0], r->out + r->out_len, out_cap - r->out_len)
					 : read(po[0], sink, sizeof(sink));
			if (g > 0 && keep)
				r->out_len += (size_t)g;
			else if (g == 0 || (g < 0 && errno != EAGAIN && errno != EINTR))
				close_fd(&po[0]);
		}
		if (i_err >= 0 && p[i_err].revents) {
			char sink[1024];
			size_t room = PROTOC_STDERR_KEEP - r->err_len;
			ssize_t g = room ? read(pe[0], r->err + r->err_len, room) : read(pe[0], sink, sizeof(sink));
			if (g > 0 && room)
				r->err_len += (size_t)g;
			else if (g == 0 || (g < 0 && errno != EAGAIN && errno != EINTR))
				close_fd(&pe[0]);
		}
	}
	r->err[r->err_len] = '\0';
	close_fd(&sv[0]);
	close_fd(&po[0]);
	close_fd(&pe[0]);
	/* A process that set SIGCHLD to SIG_IGN has its children reaped for it
	 * (ECHILD): the status stays unknown (-1). */
	int st;
	pid_t w;
	while ((w = waitpid(pid, &st, 0)) < 0 && errno == EINTR)
		;
	if (w == pid)
		r->status = st;
out:
	close_fd(&sv[0]);
	close_fd(&sv[1]);
	close_fd(&po[0]);
	close_fd(&po[1]);
	close_fd(&pe[0]);
	close_fd(&pe[1]);
	close_fd(&px[0]);
	close_fd(&px[1]);
	if (rc) {
		free(r->out);
		r->out = NULL;
	}
	return rc;
}

/* protoc's stderr as one line for eb: "input:L:C: what" becomes "PATH:L:C: what";
 * its closing "Failed to parse input." goes; lines are joined with "; ". */
static void protoc_message(char *dst, size_t cap, const char *path, const char *err)
{
	size_t n = 0;
	dst[0] = '\0';
	for (const char *line = err; *line;) {
		size_t len = strcspn(line, "\n");
		const char *next = line + len + (line[len] == '\n');
		while (len && (line[len - 1] == '\r' || line[len - 1] == ' '))
			len--;
		if (len && !(len == 22 && strncmp(line, "Failed to parse input.", 22) == 0) && n + 1 < cap) {
			const char *sep = n ? "; " : "";
			int w;
			if (len > 6 && strncmp(line, "input:", 6) == 0)
				w = snprintf(dst + n, cap - n, "%s%s:%.*s", sep, path, (int)(len - 6), line + 6);
			else
				w = snprintf(dst + n, cap - n, "%s%.*s", sep, (int)len, line);
			n = w < 0 ? n : (size_t)w >= cap - n ? cap - 1 : n + (size_t)w;
		}
		line = next;
	}
}

static td_err load_text(Traind__JobSpec **out, const char *path, const uint8_t *text, size_t len,
			struct td_errbuf *eb)
{
	const char *proto = proto_file();
	if (access(proto, R_OK) != 0) {
		char es[128];
		return td_fail(eb, TD_EUNSUPPORTED, "%s: text-format job specs need traind.proto: %s: %s", path,
			       proto, errno_str(errno, es, sizeof(es)));
	}
	char *protoc = find_protoc();
	if (!protoc)
		return td_fail(eb, TD_EUNSUPPORTED,
			       "%s: text-format job specs need protoc (%s), which is not installed; install "
			       "protobuf-compiler or submit a binary .pb spec",
			       path, getenv("TD_PROTOC") && *getenv("TD_PROTOC") ? getenv("TD_PROTOC") : TD_PROTOC);

	/* --proto_path is the .proto's directory and the file is named by its path
	 * as given, which protoc maps into that directory. */
	char *dir = strdup(proto), *incl = NULL;
	td_err rc = TD_OK;
	if (!dir) {
		rc = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
		goto done;
	}
	char *slash = strrchr(dir, '/');
	if (!slash)
		strcpy(dir, ".");
	else if (slash == dir)
		slash[1] = '\0';
	else
		*slash = '\0';
	if (asprintf(&incl, "--proto_path=%s", dir) < 0) {
		incl = NULL;
		rc = td_fail(eb, TD_ENOMEM, "%s: out of memory", path);
		goto done;
	}
	char *argv[] = { protoc, incl, (char *)"--encode=traind.JobSpec", (char *)proto, NULL };

	struct protoc_run r;
	rc = run_protoc(argv, text, len, &r, eb);
	if (rc)
		goto done;
	bool exited_ok = r.status == -1 ? r.err_len == 0 : WIFEXITED(r.status) && WEXITSTATUS(r.status) == 0;
	if (r.timed_out) {
		rc = td_fail(eb, TD_EIO, "%s: protoc did not finish in %d s", path, PROTOC_TIMEOUT_MS / 1000);
	} else if (!exited_ok) {
		char msg[sizeof(eb->msg)];
		protoc_message(msg, sizeof(msg), path, r.err);
		if (strncmp(msg, path, strlen(path)) == 0 && msg[strlen(path)] == ':')
			rc = td_fail(eb, TD_EFORMAT, "%s", msg); /* names the line: says it all */
		else if (r.status != -1 && WIFSIGNALED(r.status))
			rc = td_fail(eb, TD_EIO, "%s: protoc killed by signal %d%s%s", path, WTERMSIG(r.status),
				     *msg ? ": " : "", msg);
		else
			rc = td_fail(eb, TD_EFORMAT, "%s: protoc --encode=traind.JobSpec failed (exit %d)%s%s", path,
				     r.status != -1 && WIFEXITED(r.status) ? WEXITSTATUS(r.status) : -1,
				     *msg ? ": " : "", msg);
	} else if (r.out_nomem) {
		rc = td_fail(eb, TD_ENOMEM, "%s: out of memory reading protoc's output", path);
	} else if (r.out_overflow || r.out_len > RPC_JOBSPEC_MAX_BYTES) {
		rc = td_fail(eb, TD_ERANGE, "%s: the encoded spec is over %u bytes", path, RPC_JOBSPEC_MAX_BYTES);
	} else {
		rc = decode_named(out, r.out, r.out_len, path, eb);
	}
	free(r.out);
done:
	free(incl);
	free(dir);
	free(protoc);
	return rc;
}

td_err rpc_jobspec_load(Traind__JobSpec **out, const char *path, struct td_errbuf *eb)
{
	if (!out || !path || !*path)
		return td_fail(eb, TD_EINVAL, "job spec: no path given");
	bool text;
	if (has_suffix(path, ".pb") || has_suffix(path, ".binpb"))
		text = false;
	else if (has_suffix(path, ".txtpb") || has_suffix(path, ".textproto") || has_suffix(path, ".txt"))
		text = true;
	else
		return td_fail(eb, TD_EINVAL,
			       "%s: unknown job spec format (expected .pb or .binpb for binary, .txtpb, "
			       ".textproto or .txt for text)",
			       path);
	uint8_t *buf;
	size_t len;
	td_err rc = read_bounded(path, &buf, &len, eb);
	if (rc)
		return rc;
	rc = text ? load_text(out, path, buf, len, eb) : decode_named(out, buf, len, path, eb);
	free(buf);
	return rc;
}

/* ------------------------------------------------------------------------ */
/* Defaults */

static size_t scalar_size(ProtobufCType t)
{
	switch (t) {
	case PROTOBUF_C_TYPE_INT32:
	case PROTOBUF_C_TYPE_SINT32:
	case PROTOBUF_C_TYPE_SFIXED32:
	case PROTOBUF_C_TYPE_UINT32:
	case PROTOBUF_C_TYPE_FIXED32:
	case PROTOBUF_C_TYPE_FLOAT:
	case PROTOBUF_C_TYPE_ENUM:
		return 4;
	case PROTOBUF_C_TYPE_INT64:
	case PROTOBUF_C_TYPE_SINT64:
	case PROTOBUF_C_TYPE_SFIXED64:
	case PROTOBUF_C_TYPE_UINT64:
	case PROTOBUF_C_TYPE_FIXED64:
	case PROTOBUF_C_TYPE_DOUBLE:
		return 8;
	case PROTOBUF_C_TYPE_BOOL:
		return sizeof(protobuf_c_boolean);
	default:
		return 0;
	}
}

/* For every optional field of m and, recursively, of its sub-messages
 * (allocated here when absent): an absent scalar with a [default] takes it and
 * is marked present; a string still at its default gets its own copy, so that it
 * is encoded with the spec. Allocations are malloc's, as protobuf-c's. */
static td_err fill_static_defaults(ProtobufCMessage *m)
{
	const ProtobufCMessageDescriptor *d = m->descriptor;
	for (unsigned i = 0; i < d->n_fields; i++) {
		const ProtobufCFieldDescriptor *f = &d->fields[i];
		char *member = (char *)m + f->offset;
		if (f->label != PROTOBUF_C_LABEL_OPTIONAL || (f->flags & PROTOBUF_C_FIELD_FLAG_ONEOF))
			continue;
		if (f->type == PROTOBUF_C_TYPE_MESSAGE) {
			ProtobufCMessage **sub = (ProtobufCMessage **)member;
			if (!*sub) {
				const ProtobufCMessageDescriptor *sd = f->descriptor;
				ProtobufCMessage *n = malloc(sd->sizeof_message);
				if (!n)
					return TD_ENOMEM;
				sd->message_init(n);
				*sub = n;
			}
			td_err e = fill_static_defaults(*sub);
			if (e)
				return e;
		} else if (f->type == PROTOBUF_C_TYPE_STRING) {
			char **str = (char **)member;
			if (f->default_value && (!*str || *str == (const char *)f->default_value)) {
				char *c = strdup(f->default_value);
				if (!c)
					return TD_ENOMEM;
				*str = c;
			}
		} else if (f->default_value && scalar_size(f->type)) {
			protobuf_c_boolean *has = (protobuf_c_boolean *)((char *)m + f->quantifier_offset);
			if (!*has) {
				memcpy(member, f->default_value, scalar_size(f->type));
				*has = 1;
			}
		}
	}
	return TD_OK;
}

/* "/models/qwen2-0.5b/" -> "qwen2-0.5b"; NULL when there is no name in it
 * ("", "/") or no memory. */
static char *dir_base_name(const char *dir)
{
	size_t end = strlen(dir);
	while (end && dir[end - 1] == '/')
		end--;
	size_t start = end;
	while (start && dir[start - 1] != '/')
		start--;
	return end > start ? strndup(dir + start, end - start) : NULL;
}

static const char *const lora_default_modules[] = { "q_proj", "v_proj" };

td_err rpc_jobspec_apply_defaults(Traind__JobSpec *s, struct td_errbuf *eb)
{
	if (!s)
		return td_fail(eb, TD_EINVAL, "job spec: NULL");
	/* data.packing's default depends on the method: note whether it was given. */
	bool packing_given = s->data && s->data->has_packing;
	td_err e = fill_static_defaults(&s->base);
	if (e)
		goto nomem;

	if (!s->has_method || s->method == TRAIND__METHOD__METHOD_UNSPECIFIED) {
		s->method = TRAIND__METHOD__METHOD_FULL;
		s->has_method = 1;
	}
	/* A model_dir of "" or "/" has no base name: name stays absent. */
	if (!s->name && s->model_dir && strspn(s->model_dir, "/") != strlen(s->model_dir) &&
	    !(s->name = dir_base_name(s->model_dir)))
		goto nomem;

	Traind__DataSpec *d = s->data;
	if (!d->has_format || d->format == TRAIND__DATA_FORMAT__DATA_FORMAT_UNSPECIFIED) {
		d->format = d->train_file && has_suffix(d->train_file, ".jsonl") ? TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL
										: TRAIND__DATA_FORMAT__DATA_FORMAT_TOKENS;
		d->has_format = 1;
	}
	bool classify = s->method == TRAIND__METHOD__METHOD_CLASSIFY;
	if (classify && !packing_given)
		d->packing = 0; /* one row a sequence */
	if (!d->has_overflow || d->overflow == TRAIND__OVERFLOW__OVERFLOW_UNSPECIFIED) {
		d->overflow = classify ? TRAIND__OVERFLOW__OVERFLOW_TRUNCATE : TRAIND__OVERFLOW__OVERFLOW_SPLIT;
		d->has_overflow = 1;
	}
	if (d->has_rows && d->rows == TRAIND__ROW_FORMAT__ROWS_UNSPECIFIED)
		d->has_rows = 0; /* absent: from the first row */

	Traind__Resources *res = s->resources;
	if (!res->has_device || res->device == TRAIND__DEVICE__DEVICE_UNSPECIFIED) {
		res->device = TRAIND__DEVICE__DEVICE_ANY;
		res->has_device = 1;
	}

	Traind__Hyper *h = s->hyper;
	if (!h->has_schedule || h->schedule == TRAIND__SCHEDULE__SCHEDULE_UNSPECIFIED) {
		h->schedule = TRAIND__SCHEDULE__SCHEDULE_COSINE;
		h->has_schedule = 1;
	}
	if (!h->has_max_steps && !h->has_epochs) {
		h->epochs = 1.0;
		h->has_epochs = 1;
	}
	if (h->has_precision && h->precision == TRAIND__PRECISION__PRECISION_UNSPECIFIED)
		h->has_precision = 0;
	if (!h->has_precision && res->device == TRAIND__DEVICE__DEVICE_CPU) {
		h->precision = TRAIND__PRECISION__PRECISION_FP32;
		h->has_precision = 1;
	} else if (!h->has_precision && res->device == TRAIND__DEVICE__DEVICE_GPU) {
		h->precision = TRAIND__PRECISION__PRECISION_BF16;
		h->has_precision = 1;
	}

	Traind__LoraSpec *l = s->lora;
	if (!l->has_alpha) {
		l->alpha = 2.0 * l->rank;
		l->has_alpha = 1;
	}
	if (l->n_target_modules == 0) {
		size_t n = sizeof(lora_default_modules) / sizeof(lora_default_modules[0]);
		char **v = calloc(n, sizeof(*v));
		if (!v)
			goto nomem;
		for (size_t i = 0; i < n; i++) {
			if (!(v[i] = strdup(lora_default_modules[i]))) {
				while (i--)
					free(v[i]);
				free(v);
				goto nomem;
			}
		}
		free(l->target_modules); /* an empty array may still be allocated */
		l->target_modules = v;
		l->n_target_modules = n;
	}
	return TD_OK;
nomem:
	return td_fail(eb, TD_ENOMEM, "job spec: out of memory applying defaults");
}

td_err rpc_jobspec_resolve_precision(Traind__JobSpec *s, bool on_gpu, struct td_errbuf *eb)
{
	if (!s)
		return td_fail(eb, TD_EINVAL, "job spec: NULL");
	if (!s->hyper) {
		if (!(s->hyper = malloc(sizeof(*s->hyper))))
			return td_fail(eb, TD_ENOMEM, "job spec: out of memory");
		traind__hyper__init(s->hyper);
	}
	Traind__Hyper *h = s->hyper;
	if (!h->has_precision || h->precision == TRAIND__PRECISION__PRECISION_UNSPECIFIED) {
		h->precision = on_gpu ? TRAIND__PRECISION__PRECISION_BF16 : TRAIND__PRECISION__PRECISION_FP32;
		h->has_precision = 1;
	} else if (h->precision == TRAIND__PRECISION__PRECISION_BF16 && !on_gpu) {
		return td_fail(eb, TD_EUNSUPPORTED, "hyper.precision: BF16 needs a GPU; the CPU backend is FP32 only");
	}
	return TD_OK;
}

/* ------------------------------------------------------------------------ */
/* Validation */

enum bound { B_NONE, B_OPEN, B_CLOSED };

/* v must be finite and within the bounds; the message names the bounds as the
 * proto comments do: "> 0", "in [0, 1)". */
static td_err check_real(struct td_errbuf *eb, const char *path, double v, enum bound lb, double lo,
			 enum bound hb, double hi)
{
	if (!isfinite(v))
		return td_fail(eb, TD_EINVAL, "%s: must be a finite number (got %g)", path, v);
	bool ok = (lb == B_NONE || (lb == B_OPEN ? v > lo : v >= lo)) &&
		  (hb == B_NONE || (hb == B_OPEN ? v < hi : v <= hi));
	if (ok)
		return TD_OK;
	if (lb != B_NONE && hb != B_NONE)
		return td_fail(eb, TD_EINVAL, "%s: must be in %c%g, %g%c (got %g)", path, lb == B_OPEN ? '(' : '[',
			       lo, hi, hb == B_OPEN ? ')' : ']', v);
	if (lb != B_NONE)
		return td_fail(eb, TD_EINVAL, "%s: must be %s %g (got %g)", path, lb == B_OPEN ? ">" : ">=", lo, v);
	return td_fail(eb, TD_EINVAL, "%s: must be %s %g (got %g)", path, hb == B_OPEN ? "<" : "<=", hi, v);
}

static td_err check_int(struct td_errbuf *eb, const char *path, long long v, long long lo, long long hi)
{
	if (v >= lo && v <= hi)
		return TD_OK;
	if (hi == LLONG_MAX)
		return td_fail(eb, TD_EINVAL, "%s: must be >= %lld (got %lld)", path, lo, v);
	return td_fail(eb, TD_EINVAL, "%s: must be in %lld .. %lld (got %lld)", path, lo, hi, v);
}

/* A path or name that, when given, must not be empty. */
static td_err check_str(struct td_errbuf *eb, const char *path, const char *v, bool required)
{
	if (!v)
		return required ? td_fail(eb, TD_EINVAL, "%s: required", path) : TD_OK;
	if (!*v)
		return td_fail(eb, TD_EINVAL, "%s: must not be empty", path);
	return TD_OK;
}

static td_err check_enum(struct td_errbuf *eb, const char *path, const ProtobufCEnumDescriptor *d, int v)
{
	if (enum_known(d, v))
		return TD_OK;
	return td_fail(eb, TD_EINVAL, "%s: unknown value %d", path, v);
}

#define TRY(x)                     \
	do {                       \
		td_err e_ = (x);   \
		if (e_)            \
			return e_; \
	} while (0)

static const char *const lora_modules[] = { "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj" };
#define N_LORA_MODULES (sizeof(lora_modules) / sizeof(lora_modules[0]))

/* data.chat_template: {role}, {content} exactly once, {{ and }}; nothing else
 * in braces (train/data.h). */
static td_err check_chat_template(struct td_errbuf *eb, const char *t)
{
	TRY(check_str(eb, "data.chat_template", t, true));
	int content = 0;
	for (size_t i = 0; t[i]; i++) {
		if (strncmp(t + i, "{role}", 6) == 0) {
			i += 5;
		} else if (strncmp(t + i, "{content}", 9) == 0) {
			content++;
			i += 8;
		} else if ((t[i] == '{' || t[i] == '}') && t[i + 1] == t[i]) {
			i++;
		} else if (t[i] == '{' || t[i] == '}') {
			return td_fail(eb, TD_EINVAL,
				       "data.chat_template: '%c' at byte %zu is not a placeholder ({role}, {content}, {{ and }})",
				       t[i], i);
		}
	}
	if (content != 1)
		return td_fail(eb, TD_EINVAL, "data.chat_template: needs {content} exactly once (got %d)", content);
	return TD_OK;
}

static td_err check_data(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__DataSpec *d = s->data;
	TRY(check_str(eb, "data.train_file", d->train_file, true));
	TRY(check_str(eb, "data.eval_file", d->eval_file, false));
	TRY(check_enum(eb, "data.format", &traind__data_format__descriptor, d->format));
	TRY(check_str(eb, "data.text_field", d->text_field, true));
	TRY(check_str(eb, "data.prompt_field", d->prompt_field, true));
	TRY(check_str(eb, "data.completion_field", d->completion_field, true));
	TRY(check_int(eb, "data.seq_len", d->seq_len, 2, 1048576));
	TRY(check_str(eb, "data.messages_field", d->messages_field, true));
	TRY(check_chat_template(eb, d->chat_template));
	TRY(check_enum(eb, "data.overflow", &traind__overflow__descriptor, d->overflow));
	if (d->has_rows)
		TRY(check_enum(eb, "data.rows", &traind__row_format__descriptor, d->rows));
	bool classify = s->method == TRAIND__METHOD__METHOD_CLASSIFY;
	bool jsonl = d->format == TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL;
	if (classify && d->packing)
		return td_fail(eb, TD_EINVAL, "data.packing: method CLASSIFY needs one row a sequence (set packing: false)");
	if (classify && d->overflow == TRAIND__OVERFLOW__OVERFLOW_SPLIT)
		return td_fail(eb, TD_EINVAL, "data.overflow: method CLASSIFY truncates a long row (got SPLIT)");
	if (classify && d->has_rows)
		return td_fail(eb, TD_EINVAL, "data.rows: method CLASSIFY reads {text, label} rows; leave rows unset");
	if (!classify && !jsonl && !d->packing)
		return td_fail(eb, TD_EINVAL, "data.packing: false needs JSONL (token files are always packed)");
	if (!jsonl && d->has_rows)
		return td_fail(eb, TD_EINVAL, "data.rows: set for a token file (rows describe JSONL)");
	if (d->eval_every && !d->eval_file)
		return td_fail(eb, TD_EINVAL, "data.eval_every: set, but there is no data.eval_file");
	return TD_OK;
}

static td_err check_hyper(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__Hyper *h = s->hyper;
	TRY(check_real(eb, "hyper.lr", h->lr, B_OPEN, 0, B_NONE, 0));
	TRY(check_enum(eb, "hyper.schedule", &traind__schedule__descriptor, h->schedule));
	TRY(check_real(eb, "hyper.min_lr", h->min_lr, B_CLOSED, 0, B_NONE, 0));
	if (h->min_lr > h->lr)
		return td_fail(eb, TD_EINVAL, "hyper.min_lr: must be <= hyper.lr (got %g > %g)", h->min_lr, h->lr);
	if (h->has_max_steps && h->has_epochs)
		return td_fail(eb, TD_EINVAL, "hyper: set max_steps or epochs, not both");
	if (h->has_max_steps) {
		TRY(check_int(eb, "hyper.max_steps", h->max_steps > LLONG_MAX ? LLONG_MAX : (long long)h->max_steps,
			      1, LLONG_MAX));
		if (h->warmup_steps > h->max_steps)
			return td_fail(eb, TD_EINVAL,
				       "hyper.warmup_steps: must be <= hyper.max_steps (got %u > %llu)",
				       h->warmup_steps, (unsigned long long)h->max_steps);
	}
	if (h->has_epochs)
		TRY(check_real(eb, "hyper.epochs", h->epochs, B_OPEN, 0, B_NONE, 0));
	TRY(check_int(eb, "hyper.micro_batch", h->micro_batch, 1, LLONG_MAX));
	TRY(check_int(eb, "hyper.grad_accum", h->grad_accum, 1, LLONG_MAX));
	TRY(check_real(eb, "hyper.weight_decay", h->weight_decay, B_CLOSED, 0, B_NONE, 0));
	TRY(check_real(eb, "hyper.beta1", h->beta1, B_CLOSED, 0, B_OPEN, 1));
	TRY(check_real(eb, "hyper.beta2", h->beta2, B_CLOSED, 0, B_OPEN, 1));
	TRY(check_real(eb, "hyper.eps", h->eps, B_OPEN, 0, B_NONE, 0));
	TRY(check_real(eb, "hyper.clip_norm", h->clip_norm, B_CLOSED, 0, B_NONE, 0));
	if (h->has_precision)
		TRY(check_enum(eb, "hyper.precision", &traind__precision__descriptor, h->precision));
	return TD_OK;
}

static td_err check_lora(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__LoraSpec *l = s->lora;
	TRY(check_int(eb, "lora.rank", l->rank, 1, LLONG_MAX));
	TRY(check_real(eb, "lora.alpha", l->alpha, B_OPEN, 0, B_NONE, 0));
	TRY(check_real(eb, "lora.dropout", l->dropout, B_CLOSED, 0, B_OPEN, 1));
	unsigned seen = 0; /* bit i: lora_modules[i] */
	for (size_t i = 0; i < l->n_target_modules; i++) {
		const char *m = l->target_modules[i];
		size_t k = 0;
		while (k < N_LORA_MODULES && strcmp(m, lora_modules[k]) != 0)
			k++;
		if (k == N_LORA_MODULES)
			return td_fail(eb, TD_EINVAL,
				       "lora.target_modules[%zu]: unknown module '%s' (expected one of q_proj, k_proj, "
				       "v_proj, o_proj, gate_proj, up_proj, down_proj)",
				       i, m);
		if (seen & (1u << k))
			return td_fail(eb, TD_EINVAL, "lora.target_modules[%zu]: '%s' is listed twice", i, m);
		seen |= 1u << k;
	}
	TRY(check_str(eb, "lora.init_adapter", l->init_adapter, false));
	return TD_OK;
}

static td_err check_distill(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__DistillSpec *d = s->distill;
	if (s->method == TRAIND__METHOD__METHOD_DISTILL && !d->teacher_dir)
		return td_fail(eb, TD_EINVAL, "distill.teacher_dir: required for method DISTILL");
	TRY(check_str(eb, "distill.teacher_dir", d->teacher_dir, false));
	TRY(check_real(eb, "distill.temperature", d->temperature, B_OPEN, 0, B_NONE, 0));
	TRY(check_real(eb, "distill.alpha", d->alpha, B_CLOSED, 0, B_CLOSED, 1));
	return TD_OK;
}

struct label_ref {
	const char *name;
	size_t index;
};

static int label_ref_cmp(const void *a, const void *b)
{
	const struct label_ref *x = a, *y = b;
	int c = strcmp(x->name, y->name);
	return c ? c : (x->index > y->index) - (x->index < y->index);
}

/* Sorted, not pairwise: a hostile spec may carry hundreds of thousands of
 * names, and validation must stay cheap. Reports the later of two equal names. */
static td_err check_unique_labels(const Traind__ClassifySpec *c, struct td_errbuf *eb)
{
	size_t n = c->n_label_names;
	if (n < 2)
		return TD_OK;
	struct label_ref *v = malloc(n * sizeof(*v));
	if (!v)
		return td_fail(eb, TD_ENOMEM, "classify.label_names: out of memory");
	for (size_t i = 0; i < n; i++)
		v[i] = (struct label_ref){ c->label_names[i], i };
	qsort(v, n, sizeof(*v), label_ref_cmp);
	size_t dup = SIZE_MAX, first = 0;
	for (size_t i = 1; i < n; i++) {
		if (strcmp(v[i].name, v[i - 1].name) == 0 && v[i].index < dup)
			dup = v[i].index; /* the earliest name that repeats an earlier one */
	}
	td_err e = TD_OK;
	if (dup != SIZE_MAX) {
		for (size_t i = 0; i < n; i++)
			if (strcmp(c->label_names[i], c->label_names[dup]) == 0) {
				first = i;
				break;
			}
		e = td_fail(eb, TD_EINVAL, "classify.label_names[%zu]: '%s' is also label %zu", dup,
			    c->label_names[dup], first);
	}
	free(v);
	return e;
}

static td_err check_classify(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__ClassifySpec *c = s->classify;
	bool classify = s->method == TRAIND__METHOD__METHOD_CLASSIFY;
	if (classify && !c->has_num_labels)
		return td_fail(eb, TD_EINVAL, "classify.num_labels: required for method CLASSIFY");
	if (c->has_num_labels)
		TRY(check_int(eb, "classify.num_labels", c->num_labels, 2, LLONG_MAX));
	TRY(check_str(eb, "classify.label_field", c->label_field, true));
	if (c->n_label_names && !c->has_num_labels)
		return td_fail(eb, TD_EINVAL, "classify.label_names: given without classify.num_labels");
	if (c->n_label_names && c->n_label_names != c->num_labels)
		return td_fail(eb, TD_EINVAL, "classify.label_names: %zu names given for %u labels (classify.num_labels)",
			       c->n_label_names, c->num_labels);
	for (size_t i = 0; i < c->n_label_names; i++)
		if (!*c->label_names[i])
			return td_fail(eb, TD_EINVAL, "classify.label_names[%zu]: must not be empty", i);
	TRY(check_unique_labels(c, eb));
	if (classify && s->data->format != TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL)
		return td_fail(eb, TD_EINVAL,
			       "data.format: method CLASSIFY reads text and labels from JSONL (got TOKENS)");
	return TD_OK;
}

static td_err check_output(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__OutputSpec *o = s->output;
	TRY(check_str(eb, "output.dir", o->dir, true));
	TRY(check_int(eb, "output.keep_last", o->keep_last, 1, LLONG_MAX));
	if (o->shard_bytes == 0)
		return td_fail(eb, TD_EINVAL, "output.shard_bytes: must be >= 1 (got 0)");
	return TD_OK;
}

/* "tcp://HOST:PORT": HOST a name, an IPv4 address or [IPv6], PORT 1 .. 65535. */
static bool peer_address_ok(const char *a)
{
	if (strncmp(a, "tcp://", 6) != 0)
		return false;
	const char *h = a + 6, *colon = strrchr(h, ':');
	if (!colon || colon == h)
		return false;
	if (*h == '[' && colon[-1] != ']')
		return false;
	for (const char *p = h; p < colon; p++)
		if (!(isalnum((unsigned char)*p) || strchr(".-_[]:", *p)))
			return false;
	char *end;
	long port = strtol(colon + 1, &end, 10);
	return colon[1] && !*end && port >= 1 && port <= 65535;
}

/* resources.hosts: the other daemons of a job across daemons. */
static td_err check_hosts(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__Resources *r = s->resources;
	if (!r->n_hosts)
		return TD_OK;
	for (size_t i = 0; i < r->n_hosts; i++) {
		const char *h = r->hosts[i];
		if (!h || !*h)
			return td_fail(eb, TD_EINVAL, "resources.hosts[%zu]: must not be empty", i);
		if (strlen(h) > 255 || !peer_address_ok(h))
			return td_fail(eb, TD_EINVAL,
				       "resources.hosts[%zu]: '%.300s' is not a peer address "
				       "tcp://HOST:PORT (another daemon's peer_listen setting)",
				       i, h);
		for (size_t k = 0; k < i; k++)
			if (strcmp(r->hosts[k], h) == 0)
				return td_fail(eb, TD_EINVAL,
					       "resources.hosts[%zu]: '%s' is named twice (also "
					       "resources.hosts[%zu])",
					       i, h, k);
	}
	/* 16: gpu/comm.h's GPU_GANG_MAX, the ranks of one gang. */
	unsigned long world = (unsigned long)r->gpus * (1 + r->n_hosts);
	if (world > 16)
		return td_fail(eb, TD_EINVAL,
			       "resources.hosts: %zu hosts beside this daemon, %u GPUs each: %lu ranks, "
			       "and a job runs at most 16",
			       r->n_hosts, r->gpus, world);
	if (r->device == TRAIND__DEVICE__DEVICE_CPU)
		return td_fail(eb, TD_EINVAL,
			       "resources.hosts: a job across daemons runs on their GPUs, but "
			       "resources.device is CPU");
	if (s->hyper->grad_accum < world)
		return td_fail(eb, TD_EINVAL,
			       "resources.hosts: %lu ranks (%u GPUs on each of %zu daemons) share each "
			       "step's hyper.grad_accum micro-batches, at least one each, and grad_accum "
			       "is %u; set it to %lu or a multiple of it",
			       world, r->gpus, 1 + r->n_hosts, s->hyper->grad_accum, world);
	const Traind__MemorySpec *m = s->memory;
	if (m && m->has_shard && m->shard != TRAIND__SHARD__SHARD_NONE &&
	    m->shard != TRAIND__SHARD__SHARD_AUTO)
		return td_fail(eb, TD_EINVAL,
			       "memory.shard: a job across daemons (resources.hosts) keeps whole "
			       "optimizer state on every rank (its checkpoint's gather of the moments is "
			       "in one process); NONE or AUTO (which chooses NONE there)");
	return TD_OK;
}

static td_err check_resources(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__Resources *r = s->resources;
	TRY(check_enum(eb, "resources.device", &traind__device__descriptor, r->device));
	TRY(check_int(eb, "resources.priority", r->priority, -100, 100));
	/* 16: the daemon's DMN_MAX_GPUS; the host's own count is checked at submit. */
	TRY(check_int(eb, "resources.gpus", r->gpus, 1, 16));
	if (r->device == TRAIND__DEVICE__DEVICE_CPU && r->gpus > 1)
		return td_fail(eb, TD_EINVAL, "resources.gpus: %u GPUs, but resources.device is CPU",
			       r->gpus);
	/* Data parallel: the GPUs share each step's micro-batches, so that the
	 * global batch is one GPU's with the same spec (train/trainer.h). */
	if (r->gpus > 1 && s->hyper->grad_accum < r->gpus)
		return td_fail(eb, TD_EINVAL,
			       "resources.gpus: %u GPUs share each step's hyper.grad_accum micro-batches, "
			       "at least one each, and grad_accum is %u; set it to %u or a multiple of it "
			       "(a step's batch is micro_batch x grad_accum sequences, as on one GPU)",
			       r->gpus, s->hyper->grad_accum, r->gpus);
	TRY(check_hosts(s, eb));
	if (r->device == TRAIND__DEVICE__DEVICE_CPU && !r->allow_cpu)
		return td_fail(eb, TD_EINVAL, "resources.allow_cpu: false, but resources.device is CPU");
	if (r->device == TRAIND__DEVICE__DEVICE_CPU && s->hyper->precision == TRAIND__PRECISION__PRECISION_BF16)
		return td_fail(eb, TD_EINVAL,
			       "hyper.precision: BF16 needs a GPU (resources.device is CPU; the CPU backend is FP32 only)");
	return TD_OK;
}

static td_err check_memory(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	const Traind__MemorySpec *m = s->memory;
	if (!m)
		return TD_OK;
	/* selective layers are steps of FULL and FULL_OFFLOAD (AUTO's too) */
	if (m->selective_layers > 0 && m->has_recompute &&
	    (m->recompute == TRAIND__RECOMPUTE__RECOMPUTE_NONE ||
	     m->recompute == TRAIND__RECOMPUTE__RECOMPUTE_SELECTIVE))
		return td_fail(eb, TD_EINVAL,
			       "memory.selective_layers: %u, but memory.recompute %s keeps every layer "
			       "alike (selective layers are steps of full and full-offload)",
			       m->selective_layers,
			       m->recompute == TRAIND__RECOMPUTE__RECOMPUTE_NONE ? "none" : "selective");
	if (m->has_shard)
		TRY(check_enum(eb, "memory.shard", &traind__shard__descriptor, m->shard));
	return TD_OK;
}

/* Checks a spec on which rpc_jobspec_apply_defaults has run: every
 * sub-message is there and every defaulted scalar holds its effective value. */
static td_err check_effective(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	TRY(check_str(eb, "model_dir", s->model_dir, true));
	if (!s->name) /* model_dir "/" gives no base name to default it from */
		return td_fail(eb, TD_EINVAL, "name: required (model_dir '%s' has no base name)", s->model_dir);
	TRY(check_str(eb, "name", s->name, false));
	if (strlen(s->name) > 255)
		return td_fail(eb, TD_EINVAL, "name: longer than 255 bytes (got %zu)", strlen(s->name));
	for (const char *p = s->name; *p; p++)
		if ((unsigned char)*p < 0x20 || *p == 0x7f)
			return td_fail(eb, TD_EINVAL, "name: control character 0x%02x at byte %td", (unsigned char)*p,
				       p - s->name);
	TRY(check_enum(eb, "method", &traind__method__descriptor, s->method));
	TRY(check_data(s, eb));
	TRY(check_hyper(s, eb));
	TRY(check_lora(s, eb));
	TRY(check_distill(s, eb));
	TRY(check_classify(s, eb));
	TRY(check_output(s, eb));
	TRY(check_resources(s, eb));
	TRY(check_memory(s, eb));
	return TD_OK;
}

td_err rpc_jobspec_validate(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	if (!s)
		return td_fail(eb, TD_EINVAL, "job spec: NULL");
	Traind__JobSpec *c;
	if (rpc_jobspec_copy(&c, s))
		return td_fail(eb, TD_ENOMEM, "job spec: out of memory validating");
	td_err e = rpc_jobspec_apply_defaults(c, eb);
	if (!e)
		e = check_effective(c, eb);
	rpc_jobspec_free(c);
	return e;
}

/* ------------------------------------------------------------------------ */
/* Printing */

static void p_str(FILE *f, const char *key, const char *v, const char *absent)
{
	fprintf(f, "%s: ", key);
	if (!v) {
		fprintf(f, "%s\n", absent);
		return;
	}
	fputc('"', f);
	for (const unsigned char *p = (const unsigned char *)v; *p; p++) {
		if (*p == '"' || *p == '\\')
			fprintf(f, "\\%c", *p);
		else if (*p < 0x20 || *p == 0x7f)
			fprintf(f, "\\x%02x", *p);
		else
			fputc(*p, f);
	}
	fputs("\"\n", f);
}

static void p_list(FILE *f, const char *key, char *const *v, size_t n, const char *empty)
{
	if (!n) {
		fprintf(f, "%s: %s\n", key, empty);
		return;
	}
	for (size_t i = 0; i < n; i++) {
		char k[64];
		snprintf(k, sizeof(k), "%s[%zu]", key, i);
		p_str(f, k, v[i], "(null)");
	}
}

static void p_enum(FILE *f, const char *key, const ProtobufCEnumDescriptor *d, int v)
{
	char b[48];
	fprintf(f, "%s: %s\n", key, enum_short(d, v, b, sizeof(b)));
}

static void p_u64(FILE *f, const char *key, bool has, unsigned long long v, const char *absent)
{
	if (has)
		fprintf(f, "%s: %llu\n", key, v);
	else
		fprintf(f, "%s: %s\n", key, absent);
}

static void p_dbl(FILE *f, const char *key, bool has, double v, const char *absent)
{
	if (has) {
		/* the shortest form that reads back as the same double */
		char b[32];
		for (int prec = 6; prec <= 17; prec++) {
			snprintf(b, sizeof(b), "%.*g", prec, v);
			if (strtod(b, NULL) == v || isnan(v))
				break;
		}
		fprintf(f, "%s: %s\n", key, b);
	} else
		fprintf(f, "%s: %s\n", key, absent);
}

static void p_bool(FILE *f, const char *key, bool v)
{
	fprintf(f, "%s: %s\n", key, v ? "true" : "false");
}

void rpc_jobspec_print(const Traind__JobSpec *s, FILE *f)
{
	Traind__JobSpec *c = NULL;
	if (!s || rpc_jobspec_copy(&c, s) || rpc_jobspec_apply_defaults(c, NULL)) {
		fprintf(f, "# job spec: %s\n", s ? "out of memory" : "none");
		rpc_jobspec_free(c);
		return;
	}
	const char *unset = "(unset)";
	p_str(f, "name", c->name, unset);
	p_enum(f, "method", &traind__method__descriptor, c->method);
	p_str(f, "model_dir", c->model_dir, unset);

	const Traind__DataSpec *d = c->data;
	p_str(f, "data.train_file", d->train_file, unset);
	p_str(f, "data.eval_file", d->eval_file, "(none)");
	p_enum(f, "data.format", &traind__data_format__descriptor, d->format);
	p_str(f, "data.text_field", d->text_field, unset);
	p_str(f, "data.prompt_field", d->prompt_field, unset);
	p_str(f, "data.completion_field", d->completion_field, unset);
	p_bool(f, "data.packing", d->packing);
	p_u64(f, "data.seq_len", true, d->seq_len, unset);
	p_u64(f, "data.eos_id", d->has_eos_id, d->eos_id, "(the model's eos_token_id)");
	if (d->has_rows)
		p_enum(f, "data.rows", &traind__row_format__descriptor, d->rows);
	else
		fprintf(f, "data.rows: (from the first row)\n");
	p_str(f, "data.messages_field", d->messages_field, unset);
	p_str(f, "data.chat_template", d->chat_template, unset);
	p_bool(f, "data.assistant_only_loss", d->assistant_only_loss);
	p_bool(f, "data.add_special_tokens", d->add_special_tokens);
	p_enum(f, "data.overflow", &traind__overflow__descriptor, d->overflow);
	p_u64(f, "data.pad_id", d->has_pad_id, d->pad_id, "(the model's pad_token_id, else eos_id)");
	p_u64(f, "data.eval_every", true, d->eval_every, unset);
	p_u64(f, "data.eval_batches", true, d->eval_batches, unset);

	const Traind__Hyper *h = c->hyper;
	p_dbl(f, "hyper.lr", true, h->lr, unset);
	p_enum(f, "hyper.schedule", &traind__schedule__descriptor, h->schedule);
	p_u64(f, "hyper.warmup_steps", true, h->warmup_steps, unset);
	p_dbl(f, "hyper.min_lr", true, h->min_lr, unset);
	p_u64(f, "hyper.max_steps", h->has_max_steps, h->max_steps, "(unset: by epochs)");
	p_dbl(f, "hyper.epochs", h->has_epochs, h->epochs, "(unset: by max_steps)");
	p_u64(f, "hyper.micro_batch", true, h->micro_batch, unset);
	p_u64(f, "hyper.grad_accum", true, h->grad_accum, unset);
	p_dbl(f, "hyper.weight_decay", true, h->weight_decay, unset);
	p_dbl(f, "hyper.beta1", true, h->beta1, unset);
	p_dbl(f, "hyper.beta2", true, h->beta2, unset);
	p_dbl(f, "hyper.eps", true, h->eps, unset);
	p_dbl(f, "hyper.clip_norm", true, h->clip_norm, unset);
	p_u64(f, "hyper.seed", true, h->seed, unset);
	if (h->has_precision)
		p_enum(f, "hyper.precision", &traind__precision__descriptor, h->precision);
	else
		fprintf(f, "hyper.precision: (auto: bf16 on a GPU, fp32 on the CPU)\n");

	/* The lora section also applies to a LoRA student or classifier. */
	if (c->method == TRAIND__METHOD__METHOD_LORA || c->method == TRAIND__METHOD__METHOD_QLORA ||
	    (c->method == TRAIND__METHOD__METHOD_DISTILL && c->distill->student_lora) ||
	    (c->method == TRAIND__METHOD__METHOD_CLASSIFY && c->classify->lora)) {
		const Traind__LoraSpec *l = c->lora;
		p_u64(f, "lora.rank", true, l->rank, unset);
		p_dbl(f, "lora.alpha", true, l->alpha, unset);
		p_dbl(f, "lora.dropout", true, l->dropout, unset);
		p_list(f, "lora.target_modules", l->target_modules, l->n_target_modules, "(none)");
		p_str(f, "lora.init_adapter", l->init_adapter, "(none)");
	}
	if (c->method == TRAIND__METHOD__METHOD_QLORA ||
	    (c->method == TRAIND__METHOD__METHOD_DISTILL && c->distill->teacher_nf4))
		p_bool(f, "lora.double_quant", c->lora->double_quant);
	if (c->method == TRAIND__METHOD__METHOD_DISTILL) {
		const Traind__DistillSpec *ds = c->distill;
		p_str(f, "distill.teacher_dir", ds->teacher_dir, unset);
		p_dbl(f, "distill.temperature", true, ds->temperature, unset);
		p_dbl(f, "distill.alpha", true, ds->alpha, unset);
		p_bool(f, "distill.student_lora", ds->student_lora);
		p_bool(f, "distill.teacher_nf4", ds->teacher_nf4);
	}
	if (c->method == TRAIND__METHOD__METHOD_CLASSIFY) {
		const Traind__ClassifySpec *cl = c->classify;
		p_u64(f, "classify.num_labels", cl->has_num_labels, cl->num_labels, unset);
		p_str(f, "classify.label_field", cl->label_field, unset);
		p_list(f, "classify.label_names", cl->label_names, cl->n_label_names, "(none)");
		p_bool(f, "classify.lora", cl->lora);
	}

	const Traind__OutputSpec *o = c->output;
	p_str(f, "output.dir", o->dir, unset);
	p_u64(f, "output.checkpoint_every", true, o->checkpoint_every, unset);
	p_u64(f, "output.keep_last", true, o->keep_last, unset);
	p_u64(f, "output.shard_bytes", true, o->shard_bytes, unset);

	const Traind__Resources *r = c->resources;
	p_enum(f, "resources.device", &traind__device__descriptor, r->device);
	p_bool(f, "resources.allow_cpu", r->allow_cpu);
	fprintf(f, "resources.priority: %d\n", r->priority);
	fprintf(f, "resources.gpus: %u\n", r->gpus);
	for (size_t i = 0; i < r->n_hosts; i++)
		fprintf(f, "resources.hosts[%zu]: %s\n", i, r->hosts[i]);

	/* Unset: AUTO (the scheduler's choice where the job is placed). */
	const Traind__MemorySpec *m = c->memory;
	Traind__Recompute rc = m && m->has_recompute ? m->recompute : TRAIND__RECOMPUTE__RECOMPUTE_AUTO;
	Traind__Shard sh = m && m->has_shard ? m->shard : TRAIND__SHARD__SHARD_AUTO;
	p_enum(f, "memory.recompute", &traind__recompute__descriptor,
	       rc == TRAIND__RECOMPUTE__RECOMPUTE_UNSPECIFIED ? TRAIND__RECOMPUTE__RECOMPUTE_AUTO : rc);
	p_u64(f, "memory.max_bytes", m && m->has_max_bytes && m->max_bytes, m ? m->max_bytes : 0,
	      "(no bound)");
	fprintf(f, "memory.selective_layers: %u\n", m ? m->selective_layers : 0);
	p_enum(f, "memory.shard", &traind__shard__descriptor,
	       sh == TRAIND__SHARD__SHARD_UNSPECIFIED ? TRAIND__SHARD__SHARD_AUTO : sh);
	p_bool(f, "memory.share_base", m ? m->share_base : true);
	rpc_jobspec_free(c);
}
