/* Folding a LoRA adapter into its base (train/merge.h).
 *
 * Per adapted projection, on the backend: delta = B (out, r) @ A (r, in) as
 * matmul_forward(delta, B, A^T) (A is transposed on the host; it is r x in),
 * then delta *= scale and W += delta: PEFT's order (B @ A, times scaling,
 * added to the weight). Every other tensor is copied. */
#include "train/merge.h"

#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/select.h"
#include "train/classify.h"
#include "train/lora.h"
#include "train/modeldir.h"
#include "train/plan.h"

/* The base tensor name -> (layer, projection) of "model.layers.N.<path>.weight". */
static bool base_proj(const char *name, int *layer, int *lin)
{
	int l, n = 0;
	if (sscanf(name, "model.layers.%d.%n", &l, &n) != 1 || n == 0 || l < 0)
		return false;
	for (int k = 0; k < TR_LIN_COUNT; k++) {
		const char *path = tr_lin_path(k);
		size_t pl = strlen(path);
		if (strncmp(name + n, path, pl) == 0 && strcmp(name + n + pl, ".weight") == 0) {
			*layer = l;
			*lin = k;
			return true;
		}
	}
	return false;
}

struct merge {
	struct gpu_backend *be;
	float *w, *delta, *b, *at; /* device: W, delta (out, in), B (out, r), A^T (in, r) */
	size_t w_bytes, b_bytes, at_bytes;
};

static void merge_free(struct merge *g)
{
	if (!g->be)
		return;
	gpu_free(g->be, g->w, g->w_bytes);
	gpu_free(g->be, g->delta, g->w_bytes);
	gpu_free(g->be, g->b, g->b_bytes);
	gpu_free(g->be, g->at, g->at_bytes);
	gpu_backend_free(g->be);
}

static td_err merge_one(struct merge *g, float *w, const float *A, const float *Bm, float *at,
			int in, int out, int r, float scale, struct td_errbuf *eb)
{
	struct gpu_backend *be = g->be;
	for (int i = 0; i < r; i++)
		for (int j = 0; j < in; j++)
			at[(size_t)j * r + i] = A[(size_t)i * in + j];
	size_t wb = (size_t)out * in * sizeof(float);
	gpu_upload(be, g->w, w, wb);
	gpu_upload(be, g->b, Bm, (size_t)out * r * sizeof(float));
	gpu_upload(be, g->at, at, (size_t)in * r * sizeof(float));
	gpu_matmul_forward(be, g->delta, NULL, g->b, NULL, g->at, NULL, NULL, out, r, in);
	gpu_scale(be, g->delta, scale, (size_t)out * in);
	gpu_residual_forward(be, g->w, g->w, g->delta, (size_t)out * in);
	gpu_download(be, w, g->w, wb);
	return gpu_sync(be, eb);
}

td_err tr_merge(const char *base_dir, const char *adapter_dir, const char *out_dir,
		const char *backend, FILE *log, struct td_errbuf *eb)
{
	char path[PATH_MAX];
	struct tr_model_config cfg;
	struct tr_lora_config lc;
	struct tr_weights *w = NULL;
	struct tr_st_file *f = NULL;
	struct merge g = {0};
	float **host = NULL, *at = NULL, *A = NULL, *Bm = NULL;
	struct tr_save_tensor *ts = NULL;
	size_t n = 0, nout = 0;
	int merged = 0;
	td_err e;

	snprintf(path, sizeof(path), "%s/config.json", base_dir);
	if ((e = tr_config_load(&cfg, path, eb)) != TD_OK)
		return e;
	if ((e = tr_lora_config_load(&lc, adapter_dir, eb)) != TD_OK)
		return e;
	snprintf(path, sizeof(path), "%s/adapter_model.safetensors", adapter_dir);
	if ((e = tr_st_open(&f, path, eb)) != TD_OK)
		return e;
	const struct tr_st_tensor *head = tr_st_find(f, "base_model.model.score.weight");
	int num_labels = lc.score && head && head->ndim == 2 ? (int)head->shape[0] : 0;
	if (lc.score && !head) {
		e = td_fail(eb, TD_EMISMATCH, "%s: missing tensor 'base_model.model.score.weight' "
			    "(modules_to_save lists score)", path);
		goto out;
	}
	if ((e = tr_lora_check(&lc, &cfg, num_labels, f, eb)) != TD_OK)
		goto out;
	if ((e = tr_weights_open(&w, base_dir, eb)) != TD_OK)
		goto out;

	/* The largest adapted projection sizes the device buffers. */
	size_t maxw = 0, maxb = 0, maxat = 0;
	for (int k = 0; k < TR_LIN_COUNT; k++) {
		int in, o;
		tr_lin_dims(&cfg, k, &in, &o);
		if (!(lc.targets & (1u << k)))
			continue;
		maxw = (size_t)o * in > maxw ? (size_t)o * in : maxw;
		maxb = (size_t)o * lc.r > maxb ? (size_t)o * lc.r : maxb;
		maxat = (size_t)in * lc.r > maxat ? (size_t)in * lc.r : maxat;
	}
	if ((e = gpu_backend_open(&g.be, backend, eb)) != TD_OK)
		goto out;
	g.w_bytes = maxw * sizeof(float);
	g.b_bytes = maxb * sizeof(float);
	g.at_bytes = maxat * sizeof(float);
	if ((e = gpu_alloc(g.be, g.w_bytes, (void **)&g.w)) || (e = gpu_alloc(g.be, g.w_bytes, (void **)&g.delta)) ||
	    (e = gpu_alloc(g.be, g.b_bytes, (void **)&g.b)) || (e = gpu_alloc(g.be, g.at_bytes, (void **)&g.at))) {
		e = td_fail(eb, e, "merge: cannot allocate %zu bytes on %s", 2 * g.w_bytes + g.b_bytes + g.at_bytes,
			    g.be->ops->name);
		goto out;
	}

	n = tr_weights_count(w);
	host = calloc(n + 1, sizeof(*host));
	ts = calloc(n + 1, sizeof(*ts));
	at = malloc(g.at_bytes ? g.at_bytes : 1);
	A = malloc(g.at_bytes ? g.at_bytes : 1);
	Bm = malloc(g.b_bytes ? g.b_bytes : 1);
	if (!host || !ts || !at || !A || !Bm) {
		e = td_fail(eb, TD_ENOMEM, "merge: out of memory");
		goto out;
	}
	const float scale = (float)tr_lora_scale(&lc);
	for (size_t i = 0; i < n && e == TD_OK; i++) {
		const struct tr_st_tensor *t = tr_weights_at(w, i);
		/* A classifier drops the causal head, as transformers does. */
		if (num_labels > 0 && strcmp(t->name, "lm_head.weight") == 0)
			continue;
		if (!(host[nout] = malloc((size_t)(t->numel ? t->numel : 1) * sizeof(float)))) {
			e = td_fail(eb, TD_ENOMEM, "merge: out of memory");
			break;
		}
		if ((e = tr_st_to_f32(host[nout], t, eb)) != TD_OK)
			break;
		struct tr_save_tensor *s = &ts[nout];
		s->name = t->name;
		s->ndim = t->ndim;
		memcpy(s->shape, t->shape, sizeof(s->shape));
		s->data = host[nout];
		nout++;
		int l, k, in, o;
		if (!base_proj(t->name, &l, &k) || !(lc.targets & (1u << k)) || l >= cfg.num_layers)
			continue;
		tr_lin_dims(&cfg, k, &in, &o);
		if (t->ndim != 2 || t->shape[0] != o || t->shape[1] != in) {
			e = td_fail(eb, TD_EMISMATCH, "%s: tensor '%s' is not [%d, %d] as the config implies",
				    tr_weights_file_of(w, t->name), t->name, o, in);
			break;
		}
		char an[160];
		snprintf(an, sizeof(an), "base_model.model.model.layers.%d.%s.lora_A.weight", l, tr_lin_path(k));
		const struct tr_st_tensor *ta = tr_st_find(f, an);
		snprintf(an, sizeof(an), "base_model.model.model.layers.%d.%s.lora_B.weight", l, tr_lin_path(k));
		const struct tr_st_tensor *tb = tr_st_find(f, an);
		if ((e = tr_st_to_f32(A, ta, eb)) || (e = tr_st_to_f32(Bm, tb, eb)))
			break;
		e = merge_one(&g, host[nout - 1], A, Bm, at, in, o, lc.r, scale, eb);
		merged++;
	}
	if (e == TD_OK && num_labels > 0) {
		if (!(host[nout] = malloc((size_t)head->numel * sizeof(float))))
			e = td_fail(eb, TD_ENOMEM, "merge: out of memory");
		else if ((e = tr_st_to_f32(host[nout], head, eb)) == TD_OK) {
			ts[nout] = (struct tr_save_tensor){.name = "score.weight", .ndim = 2,
							   .shape = {head->shape[0], head->shape[1]},
							   .data = host[nout]};
			nout++;
		}
	}
	if (e == TD_OK)
		e = tr_modeldir_save(out_dir, base_dir, &cfg, ts, nout, cfg.dtype, 5ull << 30, eb);
	if (e == TD_OK && num_labels > 0)
		e = tr_classify_write_config(out_dir, &cfg, num_labels, NULL, cfg.pad_token_id, eb);
	if (e == TD_OK && log)
		fprintf(log, "merged %d projections (r=%d, scale %g) of %s into %s (%s)\n", merged, lc.r,
			(double)scale, base_dir, out_dir, tr_dtype_name(cfg.dtype));
out:
	for (size_t i = 0; host && i <= n; i++)
		free(host[i]);
	free(host);
	free(ts);
	free(at);
	free(A);
	free(Bm);
	merge_free(&g);
	tr_weights_close(w);
	tr_st_close(f);
	return e;
}
