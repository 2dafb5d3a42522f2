/* Submit-time checks as the submitter, and the plan's bytes (daemon/preflight.h). */
#include "daemon/preflight.h"

#include <openssl/evp.h>

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "train/hfconfig.h"
#include "train/base.h"
#include "train/method.h"
#include "train/plan.h"

static td_err abs_path(const char *field, const char *p, struct td_errbuf *eb)
{
	if (p && *p && *p != '/')
		return td_fail(eb, TD_EINVAL,
			       "%s: '%s' is a relative path; the daemon needs absolute paths "
			       "(trainctl makes them absolute)",
			       field, p);
	return TD_OK;
}

td_err dmn_spec_check_paths(const Traind__JobSpec *s, struct td_errbuf *eb)
{
	td_err e = abs_path("model_dir", s->model_dir, eb);
	if (!e && s->data)
		e = abs_path("data.train_file", s->data->train_file, eb);
	if (!e && s->data)
		e = abs_path("data.eval_file", s->data->eval_file, eb);
	if (!e && s->output)
		e = abs_path("output.dir", s->output->dir, eb);
	if (!e && s->lora)
		e = abs_path("lora.init_adapter", s->lora->init_adapter, eb);
	if (!e && s->distill)
		e = abs_path("distill.teacher_dir", s->distill->teacher_dir, eb);
	return e;
}

/* access(2) with the thread's filesystem ids (AT_EACCESS goes by the
 * effective/fs credentials, not the real ones). ENOSYS on kernels before 5.8:
 * then the check is skipped and the run reports what happens. */
static int fs_access(const char *path, int mode)
{
#ifdef SYS_faccessat2
	return (int)syscall(SYS_faccessat2, AT_FDCWD, path, mode, AT_EACCESS);
#else
	(void)path;
	(void)mode;
	errno = ENOSYS;
	return -1;
#endif
}

static td_err need_dir(const char *field, const char *path, struct td_errbuf *eb)
{
	struct stat st;
	if (stat(path, &st) != 0)
		return td_fail(eb, td_from_errno(errno), "%s: %s: %s", field, path,
			       errno == ENOENT ? "no such directory" : strerror(errno));
	if (!S_ISDIR(st.st_mode))
		return td_fail(eb, TD_EINVAL, "%s: %s: not a directory", field, path);
	if (fs_access(path, R_OK | X_OK) != 0 && errno != ENOSYS)
		return td_fail(eb, TD_EPERM, "%s: %s: permission denied (the job reads it as you)",
			       field, path);
	return TD_OK;
}

static td_err need_file(const char *field, const char *path, struct td_errbuf *eb)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
	if (fd < 0)
		return td_fail(eb, td_from_errno(errno), "%s: %s: %s%s", field, path,
			       errno == ENOENT ? "no such file" : strerror(errno),
			       errno == EACCES ? " (the job reads it as you)" : "");
	struct stat st;
	bool reg = fstat(fd, &st) == 0 && S_ISREG(st.st_mode);
	close(fd);
	if (!reg)
		return td_fail(eb, TD_EINVAL, "%s: %s: not a regular file", field, path);
	return TD_OK;
}

/* The output dir, or its nearest existing ancestor, must be writable. */
static td_err need_writable(const char *field, const char *path, struct td_errbuf *eb)
{
	char p[PATH_MAX];
	if (snprintf(p, sizeof(p), "%s", path) >= (int)sizeof(p))
		return td_fail(eb, TD_EINVAL, "%s: path too long", field);
	for (;;) {
		struct stat st;
		if (stat(p, &st) == 0) {
			if (!S_ISDIR(st.st_mode))
				return td_fail(eb, TD_EINVAL, "%s: %s: not a directory", field, p);
			if (fs_access(p, W_OK | X_OK) != 0 && errno != ENOSYS)
				return td_fail(eb, TD_EPERM,
					       "%s: %s: not writable by you (the job writes its "
					       "output as you)",
					       field, p);
			return TD_OK;
		}
		if (errno != ENOENT)
			return td_fail(eb, td_from_errno(errno), "%s: %s: %s", field, p, strerror(errno));
		char *slash = strrchr(p, '/');
		if (!slash || slash == p)
			return td_fail(eb, TD_ENOENT, "%s: %s: no existing parent directory", field, path);
		*slash = 0;
	}
}

bool dmn_recompute_is_auto(const Traind__JobSpec *spec)
{
	const Traind__MemorySpec *m = spec->memory;
	if (!m)
		return true;
	if (m->has_max_bytes && m->max_bytes)
		return false;
	return !m->has_recompute || m->recompute == TRAIND__RECOMPUTE__RECOMPUTE_UNSPECIFIED ||
	       m->recompute == TRAIND__RECOMPUTE__RECOMPUTE_AUTO;
}

bool dmn_shard_is_auto(const Traind__JobSpec *spec)
{
	const Traind__MemorySpec *m = spec->memory;
	if (!spec->resources || spec->resources->gpus < 2)
		return false;
	if (!m)
		return true;
	if (m->has_max_bytes && m->max_bytes)
		return false;
	return !m->has_shard || m->shard == TRAIND__SHARD__SHARD_UNSPECIFIED ||
	       m->shard == TRAIND__SHARD__SHARD_AUTO;
}

uint64_t dmn_plan_of(const struct dmn_plan_bytes *pb, int sh, int k)
{
	if (sh > TR_SHARD_NONE)
		return pb->auto_policy ? pb->shard_by_policy[sh][k] : pb->shard_bytes[sh];
	return pb->auto_policy ? pb->by_policy[k] : pb->bytes;
}

enum tr_shard dmn_auto_shard(int i)
{
	static const enum tr_shard order[] = {TR_SHARD_GRADIENTS, TR_SHARD_NONE, TR_SHARD_OPTIMIZER,
					      TR_SHARD_PARAMETERS};
	_Static_assert(sizeof(order) / sizeof(order[0]) == TR_SHARD_BUILT,
		       "every sharding built has its place in AUTO's order");
	return i >= 0 && i < TR_SHARD_BUILT ? order[i] : TR_SHARD_NONE;
}

uint64_t dmn_plan_smallest(const struct dmn_plan_bytes *pb)
{
	return dmn_plan_of(pb, pb->auto_shard ? TR_SHARD_BUILT - 1 : TR_SHARD_NONE,
			   TR_RECOMPUTE_COUNT - 1);
}

static td_err checks(const Traind__JobSpec *s, struct dmn_plan_bytes *out, struct td_errbuf *eb)
{
	td_err e = need_dir("model_dir", s->model_dir, eb);
	if (e)
		return e;
	char cfgpath[PATH_MAX];
	snprintf(cfgpath, sizeof(cfgpath), "%s/config.json", s->model_dir);
	struct tr_model_config cfg;
	if ((e = tr_config_load(&cfg, cfgpath, eb)) != TD_OK)
		return e;
	if ((e = need_file("data.train_file", s->data->train_file, eb)) != TD_OK)
		return e;
	if (s->data->eval_file && *s->data->eval_file &&
	    (e = need_file("data.eval_file", s->data->eval_file, eb)) != TD_OK)
		return e;
	if (s->lora->init_adapter && *s->lora->init_adapter &&
	    (s->method == TRAIND__METHOD__METHOD_LORA || s->method == TRAIND__METHOD__METHOD_QLORA) &&
	    (e = need_dir("lora.init_adapter", s->lora->init_adapter, eb)) != TD_OK)
		return e;
	if (s->method == TRAIND__METHOD__METHOD_DISTILL && s->distill->teacher_dir &&
	    (e = need_dir("distill.teacher_dir", s->distill->teacher_dir, eb)) != TD_OK)
		return e;
	if ((e = need_writable("output.dir", s->output->dir, eb)) != TD_OK)
		return e;

	/* What the configs alone can refute (a teacher's vocabulary, an init
	 * adapter's shapes), then the trained model's plan as the method
	 * builds it. */
	if ((e = tr_method_check(s, &cfg, eb)) != TD_OK)
		return e;
	int B = (int)s->hyper->micro_batch, T = (int)s->data->seq_len;
	struct tr_plan p;
	struct tr_plan_opts po;
	if ((e = tr_method_plan_opts(s, &cfg, B, T, &po, eb)) != TD_OK ||
	    (e = tr_plan_build(&p, &cfg, &po, eb)) != TD_OK)
		return e;
	struct dmn_plan_bytes pb = {.bytes = tr_plan_total_bytes(&p),
				    .host_bytes = tr_plan_host_bytes(&p),
				    .auto_policy = dmn_recompute_is_auto(s),
				    .auto_shard = dmn_shard_is_auto(s),
				    .selective_layers = po.selective_layers};
	/* A base it may share: the files' digest, read as the submitter (once
	 * per process for the same files: train/base.h). */
	bool share = tr_method_can_share_base(s) && (!s->memory || !s->memory->has_share_base ||
						     s->memory->share_base) &&
		     (!s->resources || s->resources->gpus <= 1) && tr_plan_base_bytes(&p) > 0;
	if (share) {
		pb.base_bytes = tr_plan_base_bytes(&p);
		if ((e = tr_base_files_digest(s->model_dir, pb.base_digest, eb)) != TD_OK) {
			tr_plan_fini(&p);
			return e;
		}
	}
	tr_plan_fini(&p);
	/* Shard AUTO: the method planned NONE; each sharding built too. */
	struct tr_plan_opts so = po;
	for (int sh = TR_SHARD_OPTIMIZER; pb.auto_shard && sh < TR_SHARD_BUILT; sh++) {
		so.shard = (enum tr_shard)sh;
		if ((e = tr_plan_build(&p, &cfg, &so, eb)) != TD_OK)
			return e;
		pb.shard_bytes[sh] = tr_plan_total_bytes(&p);
		tr_plan_fini(&p);
	}
	/* AUTO: every policy's plan, for the scheduler to choose from where it
	 * places the job (the method chose NONE here, AUTO's choice without a
	 * bound). */
	pb.num_layers = cfg.num_layers;
	for (int k = 0; pb.auto_policy && k < TR_RECOMPUTE_COUNT; k++) {
		po.recompute = (enum tr_recompute)k;
		if ((e = tr_plan_build(&p, &cfg, &po, eb)) != TD_OK)
			return e;
		pb.by_policy[k] = tr_plan_total_bytes(&p);
		pb.host_by_policy[k] = tr_plan_host_bytes(&p);
		tr_plan_fini(&p);
		if ((e = tr_method_selective_layer_bytes(s, &cfg, &po, k, pb.by_policy[k],
							  &pb.sel_layer_bytes[k], eb)) != TD_OK)
			return e;
		so.recompute = po.recompute;
		for (int sh = TR_SHARD_OPTIMIZER; pb.auto_shard && sh < TR_SHARD_BUILT; sh++) {
			so.shard = (enum tr_shard)sh;
			if ((e = tr_plan_build(&p, &cfg, &so, eb)) != TD_OK)
				return e;
			pb.shard_by_policy[sh][k] = tr_plan_total_bytes(&p);
			tr_plan_fini(&p);
		}
	}
	uint64_t teacher = 0;
	if (s->method == TRAIND__METHOD__METHOD_DISTILL) {
		/* The teacher runs forward only. Planned in fp32 even when the
		 * method stores it in NF4: never below what the job uses
		 * (contract 1), at worst above. */
		char tpath[PATH_MAX];
		snprintf(tpath, sizeof(tpath), "%s/config.json", s->distill->teacher_dir);
		struct tr_model_config tcfg;
		struct tr_plan_opts to = {.B = B, .T = T, .inference = true, .gemm_bf16 = po.gemm_bf16};
		if ((e = tr_config_load(&tcfg, tpath, eb)) != TD_OK ||
		    (e = tr_plan_build(&p, &tcfg, &to, eb)) != TD_OK)
			return e;
		teacher = tr_plan_total_bytes(&p);
		tr_plan_fini(&p);
	}
	pb.bytes += teacher;
	for (int sh = TR_SHARD_OPTIMIZER; pb.auto_shard && sh < TR_SHARD_BUILT; sh++)
		pb.shard_bytes[sh] += teacher;
	for (int k = 0; pb.auto_policy && k < TR_RECOMPUTE_COUNT; k++) {
		pb.by_policy[k] += teacher;
		for (int sh = TR_SHARD_OPTIMIZER; pb.auto_shard && sh < TR_SHARD_BUILT; sh++)
			pb.shard_by_policy[sh][k] += teacher;
	}
	*out = pb;
	return TD_OK;
}

td_err dmn_preflight(const Traind__JobSpec *spec, const struct dmn_fscreds *creds,
		     struct dmn_plan_bytes *plan, struct td_errbuf *eb)
{
	td_err e = dmn_fscreds_enter(creds, eb);
	if (e != TD_OK)
		return e;
	e = checks(spec, plan, eb);
	dmn_fscreds_leave(creds);
	return e;
}

bool dmn_base_key(const Traind__JobSpec *spec, const struct dmn_plan_bytes *pb, bool fake,
		  char out[65])
{
	if (!pb->base_bytes || !pb->base_digest[0])
		return false;
	Traind__Precision prec = spec->hyper ? spec->hyper->precision
					     : TRAIND__PRECISION__PRECISION_UNSPECIFIED;
	if (prec == TRAIND__PRECISION__PRECISION_UNSPECIFIED)
		prec = fake ? TRAIND__PRECISION__PRECISION_FP32 : TRAIND__PRECISION__PRECISION_BF16;
	else if (prec == TRAIND__PRECISION__PRECISION_BF16 && fake)
		return false; /* the CPU backend refuses it at placement */
	bool qlora = spec->method == TRAIND__METHOD__METHOD_QLORA;
	bool dq = qlora && (!spec->lora || !spec->lora->has_double_quant || spec->lora->double_quant);
	char text[256];
	int n = snprintf(text, sizeof(text), "traind base v1|%s|%s|dq %d|precision %d|%s",
			 pb->base_digest, qlora ? "nf4" : "lora", (int)dq, (int)prec,
			 fake ? "cpu" : "cuda");
	unsigned char d[32];
	unsigned int len = 0;
	if (!EVP_Digest(text, (size_t)n, d, &len, EVP_sha256(), NULL) || len != 32)
		return false;
	for (int i = 0; i < 32; i++)
		snprintf(out + 2 * i, 3, "%02x", d[i]);
	return true;
}
