/* deepen_model SRC DST LAYERS: a model dir of LAYERS decoder layers from
 * the fixture SRC's (integration tests that need more layers than the
 * fixtures have: a plan whose layers can be split between recompute
 * policies). Every tensor of SRC's model.safetensors is copied; layer l
 * >= SRC's count is a copy of layer l mod that count. config.json is SRC's
 * with num_hidden_layers set; the tokenizer files are copied by the caller.
 * The weights are a fixture's, not a trained model's: for plans and
 * scheduling, not numbers. */
#include "train/safetensors.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int main(int argc, char **argv)
{
	if (argc != 4 || atoi(argv[3]) < 1) {
		fprintf(stderr, "usage: deepen_model SRC DST LAYERS\n");
		return 2;
	}
	const int layers = atoi(argv[3]);
	char path[4096];
	struct td_errbuf eb = {{0}};
	struct tr_st_file *f;
	snprintf(path, sizeof(path), "%s/model.safetensors", argv[1]);
	if (tr_st_open(&f, path, &eb) != TD_OK) {
		fprintf(stderr, "deepen_model: %s\n", eb.msg);
		return 1;
	}
	/* the source's layer count: one past its highest "model.layers.N." */
	int have = 0;
	const size_t n = tr_st_count(f);
	for (size_t i = 0; i < n; i++) {
		int l;
		if (sscanf(tr_st_at(f, i)->name, "model.layers.%d.", &l) == 1 && l + 1 > have)
			have = l + 1;
	}
	if (have == 0) {
		fprintf(stderr, "deepen_model: %s has no model.layers.N tensors\n", path);
		return 1;
	}
	/* each tensor at most once a copy of its layer: layers / have + 1 */
	struct tr_st_entry *e = calloc(n * (size_t)(layers / have + 1), sizeof(*e));
	char **names = calloc(n * (size_t)(layers / have + 1), sizeof(*names));
	if (!e || !names) {
		fprintf(stderr, "deepen_model: out of memory\n");
		return 1;
	}
	size_t k = 0;
	for (size_t i = 0; i < n; i++) {
		const struct tr_st_tensor *t = tr_st_at(f, i);
		int l, off = 0;
		if (sscanf(t->name, "model.layers.%d.%n", &l, &off) != 1 || off == 0) {
			e[k++] = (struct tr_st_entry){t->name, t->dtype, t->ndim, {0}, t->data};
			memcpy(e[k - 1].shape, t->shape, sizeof(t->shape));
			continue;
		}
		for (int to = l; to < layers; to += have) {
			if (asprintf(&names[k], "model.layers.%d.%s", to, t->name + off) < 0)
				return 1;
			e[k] = (struct tr_st_entry){names[k], t->dtype, t->ndim, {0}, t->data};
			memcpy(e[k].shape, t->shape, sizeof(t->shape));
			k++;
		}
	}
	snprintf(path, sizeof(path), "%s/model.safetensors", argv[2]);
	if (tr_st_write(path, e, k, NULL, &eb) != TD_OK) {
		fprintf(stderr, "deepen_model: %s\n", eb.msg);
		return 1;
	}
	/* config.json: "num_hidden_layers": N rewritten in place */
	snprintf(path, sizeof(path), "%s/config.json", argv[1]);
	FILE *in = fopen(path, "r");
	char cfg[65536];
	size_t len = in ? fread(cfg, 1, sizeof(cfg) - 1, in) : 0;
	if (in)
		fclose(in);
	cfg[len] = 0;
	char *at = strstr(cfg, "\"num_hidden_layers\"");
	char *colon = at ? strchr(at, ':') : NULL;
	if (!colon) {
		fprintf(stderr, "deepen_model: %s has no num_hidden_layers\n", path);
		return 1;
	}
	char *rest = colon + 1;
	while (*rest == ' ')
		rest++;
	while (*rest >= '0' && *rest <= '9')
		rest++;
	snprintf(path, sizeof(path), "%s/config.json", argv[2]);
	FILE *out = fopen(path, "w");
	if (!out || fprintf(out, "%.*s %d%s", (int)(colon + 1 - cfg), cfg, layers, rest) < 0 ||
	    fclose(out) != 0) {
		fprintf(stderr, "deepen_model: cannot write %s\n", path);
		return 1;
	}
	for (size_t i = 0; i < k; i++)
		free(names[i]);
	free(names);
	free(e);
	tr_st_close(f);
	return 0;
}
