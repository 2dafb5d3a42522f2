/* Tokenizer throughput: the texts of a JSONL file encoded one document at a
 * time on one thread, as tests/bench/peer_tokenizers.py does with Hugging
 * Face tokenizers, so that the two lines compare:
 *
 *   bench_tokenizer [--tokenizer tokenizer.json] [--data file.jsonl]
 *                   [--field text] [--seconds S] [--check ids.bin] [--pipeline DIR]
 *
 * Prints "tokenizer impl=traind docs=N bytes=B tokens=K passes=P cold_mb_s=X
 * mb_s=Y": bytes are the texts' UTF-8 bytes; cold is the first pass (empty
 * word cache), mb_s the best later pass. --check compares every document's
 * ids with those the peer wrote (--dump), which makes this a parity check of
 * the whole file too. --pipeline also times the dataset path (JSONL to token
 * cache in DIR, one thread and the default) and prints its MB/s over the
 * file's bytes (--pipeline-only: that alone, for files too large to hold).
 * A benchmark, not a test. */
#include <json-c/json.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "train/data.h"
#include "train/tokenizer.h"

static double now_s(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct doc {
	char *s;
	size_t n;
};

static int usage(void)
{
	fprintf(stderr, "usage: bench_tokenizer [--tokenizer PATH] [--data JSONL] [--field NAME] [--seconds S] "
			"[--check IDS] [--pipeline DIR [--pipeline-only]]\n");
	return 2;
}

/* Compares each document's ids with the peer's dump: per document a
 * little-endian uint32 count, then the ids. */
static int check_ids(const char *path, struct tr_encoder *enc, const struct doc *docs, size_t ndocs)
{
	FILE *f = fopen(path, "rb");
	if (!f) {
		perror(path);
		return 2;
	}
	struct tr_ids ids = { 0 };
	struct td_errbuf eb;
	size_t bad = 0, first_bad = (size_t)-1;
	uint32_t *want = NULL;
	size_t wcap = 0;
	for (size_t i = 0; i < ndocs; i++) {
		uint32_t n;
		if (fread(&n, 4, 1, f) != 1) {
			fprintf(stderr, "%s: ends at document %zu of %zu\n", path, i, ndocs);
			bad++;
			break;
		}
		if (n > wcap) {
			wcap = n;
			want = realloc(want, wcap * sizeof(uint32_t));
		}
		if (n && fread(want, 4, n, f) != n) {
			fprintf(stderr, "%s: truncated at document %zu\n", path, i);
			bad++;
			break;
		}
		ids.n = 0;
		tr_encode(enc, docs[i].s, docs[i].n, TR_ENC_SPECIALS, &ids, &eb);
		bool same = ids.n == n;
		for (size_t k = 0; same && k < n; k++)
			same = (uint32_t)ids.v[k] == want[k];
		if (!same) {
			if (first_bad == (size_t)-1)
				first_bad = i;
			bad++;
		}
	}
	fclose(f);
	free(want);
	tr_ids_fini(&ids);
	if (bad)
		printf("check: %zu of %zu documents differ from %s (first: document %zu)\n", bad, ndocs, path, first_bad);
	else
		printf("check: all %zu documents encode to the ids in %s\n", ndocs, path);
	return bad ? 1 : 0;
}

static void pipeline(const char *data, const struct tr_tokenizer *tok, const char *dir, size_t text_bytes)
{
	struct stat st;
	if (stat(data, &st) != 0) {
		perror(data);
		return;
	}
	for (int round = 0; round < 2; round++) {
		char cache[4096], cmd[4200];
		snprintf(cache, sizeof(cache), "%s/bench-cache-%d", dir, round);
		snprintf(cmd, sizeof(cmd), "rm -rf '%s'", cache);
		if (system(cmd) != 0)
			fprintf(stderr, "could not clear %s\n", cache);
		struct tr_data_opts o = {
			.path = data, .jsonl = true, .T = 512, .vocab = tr_tokenizer_vocab_size(tok), .seed = 1,
			.packing = true, .eos_id = 0, .pad_id = 0, .tok = tok, .text_field = "text",
			.prompt_field = "prompt", .completion_field = "completion", .messages_field = "messages",
			.label_field = "label", .assistant_only_loss = true, .add_special_tokens = true,
			.cache_dir = cache, .threads = round == 0 ? 1 : 0,
		};
		struct tr_data *d = NULL;
		struct td_errbuf eb;
		double t0 = now_s();
		if (tr_data_open(&d, &o, &eb)) {
			fprintf(stderr, "pipeline: %s\n", eb.msg);
			return;
		}
		double t = now_s() - t0;
		printf("pipeline impl=traind threads=%s rows=%llu tokens=%llu file_mb_s=%.2f text_mb_s=%.2f\n",
		       round == 0 ? "1" : "auto", (unsigned long long)tr_data_num_rows(d),
		       (unsigned long long)tr_data_num_tokens(d), (double)st.st_size / 1e6 / t,
		       (double)text_bytes / 1e6 / t);
		tr_data_close(d);
	}
}

int main(int argc, char **argv)
{
	const char *tok_path = "tests/fixtures/tokenizer/tokenizer.json", *data = "tests/fixtures/demo/fortunes.jsonl";
	const char *field = "text", *check = NULL, *pipe_dir = NULL;
	double seconds = 3.0;
	bool pipeline_only = false;
	for (int i = 1; i < argc; i++) {
		if (strcmp(argv[i], "--pipeline-only") == 0) {
			pipeline_only = true;
			continue;
		}
		if (i + 1 >= argc)
			return usage();
		if (strcmp(argv[i], "--tokenizer") == 0)
			tok_path = argv[++i];
		else if (strcmp(argv[i], "--data") == 0)
			data = argv[++i];
		else if (strcmp(argv[i], "--field") == 0)
			field = argv[++i];
		else if (strcmp(argv[i], "--seconds") == 0)
			seconds = atof(argv[++i]);
		else if (strcmp(argv[i], "--check") == 0)
			check = argv[++i];
		else if (strcmp(argv[i], "--pipeline") == 0)
			pipe_dir = argv[++i];
		else
			return usage();
	}
	struct tr_tokenizer *tok = NULL;
	struct tr_encoder *enc = NULL;
	struct td_errbuf eb;
	if (tr_tokenizer_load(&tok, tok_path, &eb) || tr_encoder_new(&enc, tok, &eb)) {
		fprintf(stderr, "bench_tokenizer: %s\n", eb.msg);
		return 2;
	}
	if (pipeline_only) { /* a large file: not read into memory here */
		if (pipe_dir)
			pipeline(data, tok, pipe_dir, 0);
		tr_encoder_free(enc);
		tr_tokenizer_free(tok);
		return 0;
	}
	FILE *f = fopen(data, "r");
	if (!f) {
		perror(data);
		return 2;
	}
	struct doc *docs = NULL;
	size_t ndocs = 0, cap = 0, bytes = 0;
	char *line = NULL;
	size_t lcap = 0;
	ssize_t len;
	while ((len = getline(&line, &lcap, f)) > 0) {
		struct json_object *o = json_tokener_parse(line), *v;
		if (o && json_object_object_get_ex(o, field, &v) && json_object_is_type(v, json_type_string)) {
			if (ndocs == cap)
				docs = realloc(docs, (cap = cap ? 2 * cap : 1024) * sizeof(*docs));
			docs[ndocs].n = (size_t)json_object_get_string_len(v);
			docs[ndocs].s = malloc(docs[ndocs].n + 1);
			memcpy(docs[ndocs].s, json_object_get_string(v), docs[ndocs].n + 1);
			bytes += docs[ndocs++].n;
		}
		json_object_put(o);
	}
	free(line);
	fclose(f);
	if (!ndocs) {
		fprintf(stderr, "bench_tokenizer: %s: no \"%s\" rows\n", data, field);
		return 2;
	}

	struct tr_ids ids = { 0 };
	double cold = 0, best = 1e30, total = 0;
	size_t tokens = 0;
	int passes = 0;
	while (passes < 2 || total < seconds) {
		double t0 = now_s();
		size_t k = 0;
		for (size_t i = 0; i < ndocs; i++) {
			ids.n = 0;
			if (tr_encode(enc, docs[i].s, docs[i].n, TR_ENC_SPECIALS, &ids, &eb)) {
				fprintf(stderr, "bench_tokenizer: document %zu: %s\n", i, eb.msg);
				return 2;
			}
			k += ids.n;
		}
		double t = now_s() - t0;
		if (passes == 0)
			cold = t;
		else if (t < best)
			best = t;
		total += t;
		tokens = k;
		passes++;
	}
	printf("tokenizer impl=traind docs=%zu bytes=%zu tokens=%zu passes=%d cold_mb_s=%.2f mb_s=%.2f\n", ndocs, bytes,
	       tokens, passes, (double)bytes / 1e6 / cold, (double)bytes / 1e6 / best);
	int rc = check ? check_ids(check, enc, docs, ndocs) : 0;
	if (pipe_dir)
		pipeline(data, tok, pipe_dir, bytes);
	for (size_t i = 0; i < ndocs; i++)
		free(docs[i].s);
	free(docs);
	tr_ids_fini(&ids);
	tr_encoder_free(enc);
	tr_tokenizer_free(tok);
	return rc;
}
