/* Datasets: JSONL rows to sequences, against encodings made here with the
 * tokenizer (itself checked against Hugging Face by `parity`):
 *   - labels are -100 exactly over the prompt's tokens and over padding;
 *   - packing and padding, long documents split or truncated;
 *   - chat messages through ChatML (and a custom template), assistant-only
 *     loss, and equality with encoding the whole rendered conversation;
 *   - classification rows: class ids from names or ids, truncation;
 *   - errors name the file and line (a table), also past worker boundaries;
 *   - order is a function of the seed and epoch, each epoch a permutation;
 *   - the token cache is reused, rebuilt when damaged, the same for any
 *     number of worker threads;
 *   - the trainer on JSONL: a resumed job continues with the next batch (bit
 *     for bit), refuses other data, fails on bad data before it loads a
 *     model, and evaluates an eval file (checked by a forward pass here);
 *   - the job spec's data fields: defaults and validation. */
#include <dirent.h>
#include <json-c/json.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gpu/backend.h"
#include "proto/jobspec.h"
#include "tests/check.h"
#include "train/data.h"
#include "train/hfconfig.h"
#include "train/model.h"
#include "train/modeldir.h"
#include "train/tokenizer.h"
#include "train/trainer.h"

static char tmp[256];
static const char *fx;

/* tr_data_sequence, which fails only when the mapped file shrank. */
static void sequence(const struct tr_data *d, uint64_t s, int32_t *ids, int32_t *labels, int32_t *cls)
{
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(tr_data_sequence(d, s, ids, labels, cls, &eb), TD_OK);
}
static struct tr_tokenizer *tok;
static struct tr_encoder *enc;

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "wb");
	if (!f || fwrite(text, 1, strlen(text), f) != strlen(text)) {
		perror(path);
		exit(2);
	}
	fclose(f);
}

static char *tmp_path(const char *name)
{
	static char paths[8][512];
	static int k;
	char *p = paths[k++ % 8];
	snprintf(p, 512, "%s/%s", tmp, name);
	return p;
}

/* Options for a JSONL file in tmp with the fixture tokenizer (vocab 512,
 * <|endoftext|> = 0 as EOS, pad 3 so that padding is told from EOS). */
static struct tr_data_opts jopts(const char *path, int T)
{
	return (struct tr_data_opts){
		.path = path,
		.jsonl = true,
		.T = T,
		.vocab = 512,
		.seed = 1,
		.shuffle = false,
		.packing = false,
		.eos_id = 0,
		.pad_id = 3,
		.tok = tok,
		.text_field = "text",
		.prompt_field = "prompt",
		.completion_field = "completion",
		.messages_field = "messages",
		.label_field = "label",
		.assistant_only_loss = true,
		.add_special_tokens = true,
		.cache_dir = tmp_path("cache"),
		.threads = 1,
	};
}

static struct tr_data *open_ok(const struct tr_data_opts *o)
{
	struct tr_data *d = NULL;
	struct td_errbuf eb = { { 0 } };
	td_err e = tr_data_open(&d, o, &eb);
	CHECK_MSG(e == TD_OK, "open %s: %s", o->path, eb.msg);
	return e == TD_OK ? d : NULL;
}

/* Appends encode(s) to ids, and its labels (the ids, or -100 if masked). */
static void expect(struct tr_ids *ids, struct tr_ids *labels, const char *s, bool masked)
{
	struct tr_ids part = { 0 };
	struct td_errbuf eb = { { 0 } };
	CHECK_MSG(tr_encode(enc, s, strlen(s), TR_ENC_SPECIALS, &part, &eb) == TD_OK, "%s", eb.msg);
	for (size_t i = 0; i < part.n; i++) {
		tr_ids_push(ids, part.v[i]);
		tr_ids_push(labels, masked ? -100 : part.v[i]);
	}
	tr_ids_fini(&part);
}

static void expect_id(struct tr_ids *ids, struct tr_ids *labels, int32_t id, int32_t label)
{
	tr_ids_push(ids, id);
	tr_ids_push(labels, label);
}

/* Compares sequence s of d with want[off .. off + T) (padding beyond n). */
static void check_seq(const struct tr_data *d, uint64_t s, int T, const struct tr_ids *wi, const struct tr_ids *wl,
		      size_t off, const char *what)
{
	int32_t ids[512], labels[512], cls;
	sequence(d, s, ids, labels, &cls);
	int bad = -1;
	for (int t = 0; t < T && bad < 0; t++) {
		bool real = off + (size_t)t < wi->n;
		int32_t want_id = real ? wi->v[off + t] : tr_data_pad_id(d);
		int32_t want_label = real ? wl->v[off + t] : -100;
		if (ids[t] != want_id || labels[t] != want_label)
			bad = t;
	}
	CHECK_MSG(bad < 0, "%s: sequence %llu position %d: id %d label %d, want id %d label %d", what,
		  (unsigned long long)s, bad, bad >= 0 ? ids[bad] : 0, bad >= 0 ? labels[bad] : 0,
		  bad >= 0 && off + (size_t)bad < wi->n ? wi->v[off + bad] : tr_data_pad_id(d),
		  bad >= 0 && off + (size_t)bad < wl->n ? wl->v[off + bad] : -100);
}

/* ------------------------------------------------------------------------ */

static const char *const prompts[][2] = {
	{ "Complete the saying: The fact that it", " works is immaterial.\n\t\t-- L. Ogborn" },
	{ "Q: caf\xc3\xa9? ", "A: \xe6\x97\xa5\xe6\x9c\xac" }, /* a prompt ending in a space */
	{ "<|im_start|>x", "y<|im_end|>" },                   /* specials in the text */
};

static void write_prompts(const char *path)
{
	char text[2048] = "";
	for (size_t i = 0; i < 3; i++) {
		char line[512];
		struct json_object *o = json_object_new_object();
		json_object_object_add(o, "prompt", json_object_new_string(prompts[i][0]));
		json_object_object_add(o, "completion", json_object_new_string(prompts[i][1]));
		snprintf(line, sizeof(line), "%s\n", json_object_to_json_string_ext(o, JSON_C_TO_STRING_PLAIN));
		json_object_put(o);
		strcat(text, line);
	}
	write_file(path, text);
}

static void test_prompt_masks(void)
{
	const char *path = tmp_path("pc.jsonl");
	write_prompts(path);
	struct tr_ids all_ids = { 0 }, all_labels = { 0 };
	/* Padding: row r is sequence r; the prompt is masked, the completion and
	 * its EOS are trained, the padding is masked. */
	struct tr_data_opts o = jopts(path, 64);
	struct tr_data *d = open_ok(&o);
	if (!d)
		return;
	CHECK_EQ_INT(tr_data_num_sequences(d), 3);
	CHECK_EQ_INT(tr_data_num_rows(d), 3);
	for (size_t r = 0; r < 3; r++) {
		struct tr_ids ids = { 0 }, labels = { 0 };
		expect(&ids, &labels, prompts[r][0], true);
		size_t np = ids.n;
		expect(&ids, &labels, prompts[r][1], false);
		expect_id(&ids, &labels, 0, 0);
		CHECK(np > 0 && ids.n > np + 1);
		check_seq(d, r, 64, &ids, &labels, 0, "padded prompt/completion");
		/* and the count: exactly np labels of the row are -100 */
		int32_t si[64], sl[64];
		sequence(d, r, si, sl, NULL);
		size_t masked_prompt = 0;
		while (masked_prompt < 64 && sl[masked_prompt] == -100)
			masked_prompt++;
		CHECK_EQ_INT(masked_prompt, np);
		for (size_t k = 0; k < ids.n; k++) {
			tr_ids_push(&all_ids, ids.v[k]);
			tr_ids_push(&all_labels, labels.v[k]);
		}
		tr_ids_fini(&ids);
		tr_ids_fini(&labels);
	}
	tr_data_close(d);

	/* Packing: the same rows as one stream cut into sequences of 16. */
	o = jopts(path, 16);
	o.packing = true;
	d = open_ok(&o);
	if (d) {
		CHECK_EQ_INT(tr_data_num_sequences(d), (all_ids.n + 15) / 16);
		for (uint64_t s = 0; s < tr_data_num_sequences(d); s++)
			check_seq(d, s, 16, &all_ids, &all_labels, s * 16, "packed prompt/completion");
		tr_data_close(d);
	}
	tr_ids_fini(&all_ids);
	tr_ids_fini(&all_labels);
}

/* Texts of known lengths, T = 8, every layout. */
static void test_layouts(void)
{
	static const char *const texts[] = {
		"The whole history of computers is rampant with cheerleading at best and bigotry at worst.",
		"To teach is to learn.",
		"a",
		"Those who believe that they believe in God, but without passion in their hearts.",
	};
	const char *path = tmp_path("text.jsonl");
	char body[1024] = "";
	for (size_t i = 0; i < 4; i++) {
		char line[256];
		snprintf(line, sizeof(line), "{\"text\": \"%s\"}\n%s", texts[i], i == 1 ? "\n   \n" : "");
		strcat(body, line);
	}
	write_file(path, body); /* with blank lines, which are no rows */
	enum { T = 8 };
	struct tr_ids row_ids[4] = { { 0 } }, row_labels[4] = { { 0 } };
	for (size_t i = 0; i < 4; i++) {
		expect(&row_ids[i], &row_labels[i], texts[i], false);
		expect_id(&row_ids[i], &row_labels[i], 0, 0);
	}
	for (int packing = 0; packing < 2; packing++)
		for (int truncate = 0; truncate < 2; truncate++) {
			struct tr_data_opts o = jopts(path, T);
			o.packing = packing;
			o.truncate = truncate;
			struct tr_data *d = open_ok(&o);
			if (!d)
				continue;
			char what[64];
			snprintf(what, sizeof(what), "packing %d truncate %d", packing, truncate);
			CHECK_EQ_INT(tr_data_num_rows(d), 4);
			uint64_t s = 0;
			if (packing) {
				struct tr_ids si = { 0 }, sl = { 0 };
				for (size_t i = 0; i < 4; i++)
					for (size_t k = 0; k < row_ids[i].n && (!truncate || k < T); k++)
						expect_id(&si, &sl, row_ids[i].v[k], row_labels[i].v[k]);
				CHECK_EQ_INT(tr_data_num_sequences(d), (si.n + T - 1) / T);
				for (; s < tr_data_num_sequences(d); s++)
					check_seq(d, s, T, &si, &sl, s * T, what);
				tr_ids_fini(&si);
				tr_ids_fini(&sl);
			} else {
				for (size_t i = 0; i < 4; i++) {
					size_t pieces = truncate ? 1 : (row_ids[i].n + T - 1) / T;
					for (size_t k = 0; k < pieces; k++, s++) {
						/* a piece: the row's tokens from k*T, padded */
						struct tr_ids pi = { 0 }, pl = { 0 };
						for (size_t t = k * T; t < row_ids[i].n && t < (k + 1) * T; t++)
							expect_id(&pi, &pl, row_ids[i].v[t], row_labels[i].v[t]);
						check_seq(d, s, T, &pi, &pl, 0, what);
						tr_ids_fini(&pi);
						tr_ids_fini(&pl);
					}
				}
				CHECK_EQ_INT(tr_data_num_sequences(d), s);
			}
			tr_data_close(d);
		}
	for (size_t i = 0; i < 4; i++) {
		tr_ids_fini(&row_ids[i]);
		tr_ids_fini(&row_labels[i]);
	}
}

static void test_messages(void)
{
	const char *path = tmp_path("chat.jsonl");
	write_file(path, "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
			 "{\"role\": \"user\", \"content\": \"Who said it?\"}, "
			 "{\"role\": \"assistant\", \"content\": \"Larry Wall, in 1991.\"}]}\n");
	static const char *const parts[][2] = { { "system", "Be brief." },
						{ "user", "Who said it?" },
						{ "assistant", "Larry Wall, in 1991." } };
	for (int only = 0; only < 2; only++) {
		struct tr_ids ids = { 0 }, labels = { 0 };
		for (size_t i = 0; i < 3; i++) {
			char head[64], body[128];
			snprintf(head, sizeof(head), "<|im_start|>%s\n", parts[i][0]);
			snprintf(body, sizeof(body), "%s<|im_end|>\n", parts[i][1]);
			expect(&ids, &labels, head, only);
			expect(&ids, &labels, body, only && strcmp(parts[i][0], "assistant") != 0);
		}
		expect_id(&ids, &labels, 0, 0);
		struct tr_data_opts o = jopts(path, 128);
		o.assistant_only_loss = only;
		struct tr_data *d = open_ok(&o);
		if (d) {
			check_seq(d, 0, 128, &ids, &labels, 0, only ? "chatml assistant-only" : "chatml all");
			tr_data_close(d);
		}
		/* ChatML in parts equals the whole rendered conversation at once */
		struct tr_ids whole = { 0 }, wl = { 0 };
		expect(&whole, &wl,
		       "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWho said it?<|im_end|>\n"
		       "<|im_start|>assistant\nLarry Wall, in 1991.<|im_end|>\n",
		       false);
		CHECK(whole.n + 1 == ids.n && memcmp(whole.v, ids.v, whole.n * sizeof(int32_t)) == 0);
		tr_ids_fini(&whole);
		tr_ids_fini(&wl);
		tr_ids_fini(&ids);
		tr_ids_fini(&labels);
	}
	/* A custom template with literal braces; the auto-detected kind. */
	struct tr_ids ids = { 0 }, labels = { 0 };
	expect(&ids, &labels, "{s} system: ", true);
	expect(&ids, &labels, "Be brief.\n", true);
	expect(&ids, &labels, "{s} user: ", true);
	expect(&ids, &labels, "Who said it?\n", true);
	expect(&ids, &labels, "{s} assistant: ", true);
	expect(&ids, &labels, "Larry Wall, in 1991.\n", false);
	expect_id(&ids, &labels, 0, 0);
	struct tr_data_opts o = jopts(path, 128);
	o.chat_template = "{{s}} {role}: {content}\n";
	struct tr_data *d = open_ok(&o);
	if (d) {
		check_seq(d, 0, 128, &ids, &labels, 0, "custom template");
		tr_data_close(d);
	}
	tr_ids_fini(&ids);
	tr_ids_fini(&labels);
}

static void test_classify(void)
{
	const char *path = tmp_path("cls.jsonl");
	write_file(path, "{\"text\": \"Hello, world!\", \"label\": \"food\"}\n"
			 "{\"text\": \"The whole history of computers is rampant with cheerleading.\", \"label\": 0}\n"
			 "{\"label\": \"science\", \"text\": \"To teach is to learn.\"}\n");
	char *names[] = { "computers", "science", "food" };
	struct tr_data_opts o = jopts(path, 8);
	o.rows = TR_ROWS_CLASSIFY;
	o.label_names = names;
	o.n_label_names = 3;
	o.num_labels = 3;
	o.truncate = true;
	struct tr_data *d = open_ok(&o);
	if (!d)
		return;
	static const char *const texts[] = { "Hello, world!",
					     "The whole history of computers is rampant with cheerleading.",
					     "To teach is to learn." };
	static const int classes[] = { 2, 0, 1 };
	CHECK_EQ_INT(tr_data_num_sequences(d), 3);
	for (uint64_t r = 0; r < 3; r++) {
		struct tr_ids ids = { 0 }, labels = { 0 };
		expect(&ids, &labels, texts[r], false); /* no EOS in a classification row */
		check_seq(d, r, 8, &ids, &labels, 0, "classification");
		int32_t si[8], sl[8], cls = -7;
		sequence(d, r, si, sl, &cls);
		CHECK_EQ_INT(cls, classes[r]);
		/* the last non-pad token: the last label that is not -100 */
		int last = 7;
		while (last >= 0 && sl[last] == -100)
			last--;
		CHECK_EQ_INT(last, (int)(ids.n < 8 ? ids.n : 8) - 1);
		tr_ids_fini(&ids);
		tr_ids_fini(&labels);
	}
	/* through tr_data_next too */
	struct tr_data_pos pos = { 0, 0 };
	int32_t ids[24], labels[24], cls[3];
	struct td_errbuf eb;
	CHECK_EQ_INT(tr_data_next(d, &pos, ids, labels, cls, 3, &eb), TD_OK);
	CHECK(cls[0] == 2 && cls[1] == 0 && cls[2] == 1);
	tr_data_close(d);
}

/* ------------------------------------------------------------------------ */
/* Errors: the file, the line, what */

static void test_errors(void)
{
	char *names[] = { "computers", "science", "food" };
	static const struct {
		const char *name, *body;
		enum tr_rows rows;
		int vocab;
		const char *tmpl;
		td_err code;
		const char *where, *msg;
	} cases[] = {
		{ "badjson", "{\"text\": \"a\"}\n{\"text\": \"b\"}\n{\"text\": \n", TR_ROWS_AUTO, 512, NULL, TD_EFORMAT, ":3: ",
		  "not valid JSON" },
		{ "garbage", "{\"text\": \"a\"} x\n", TR_ROWS_TEXT, 512, NULL, TD_EFORMAT, ":1: ", "not valid JSON" },
		{ "array", "{\"text\": \"a\"}\n\n[1, 2]\n", TR_ROWS_TEXT, 512, NULL, TD_EFORMAT, ":3: ",
		  "expected a JSON object, got array" },
		{ "missing", "{\"text\": \"a\"}\n{\"txt\": \"b\"}\n", TR_ROWS_AUTO, 512, NULL, TD_EFORMAT, ":2: ",
		  "no \"text\" field (data.text_field)" },
		{ "type", "{\"text\": 5}\n", TR_ROWS_TEXT, 512, NULL, TD_EFORMAT, ":1: ", "\"text\" is int, expected a string" },
		{ "nocompletion", "{\"prompt\": \"a\", \"completion\": \"b\"}\n{\"prompt\": \"a\"}\n", TR_ROWS_AUTO, 512, NULL,
		  TD_EFORMAT, ":2: ", "no \"completion\" field" },
		{ "empty", "", TR_ROWS_AUTO, 512, NULL, TD_EINVAL, "empty.jsonl: ", "empty" },
		{ "blank", "\n  \n\t\n", TR_ROWS_AUTO, 512, NULL, TD_EINVAL, "blank.jsonl: ", "only blank lines" },
		{ "blank2", "\n  \n\t\n", TR_ROWS_TEXT, 512, NULL, TD_EINVAL, "blank2.jsonl: ", "only blank lines" },
		{ "unknown", "{\"foo\": 1}\n", TR_ROWS_AUTO, 512, NULL, TD_EFORMAT, ":1: ", "the first row has none of" },
		{ "msgtype", "{\"messages\": \"hi\"}\n", TR_ROWS_AUTO, 512, NULL, TD_EFORMAT, ":1: ",
		  "\"messages\" is string, expected an array" },
		{ "msgcontent", "{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"user\"}]}\n", TR_ROWS_AUTO,
		  512, NULL, TD_EFORMAT, ":1: ", "no \"content\" field (in messages[1])" },
		{ "msgempty", "{\"messages\": []}\n", TR_ROWS_MESSAGES, 512, NULL, TD_EFORMAT, ":1: ", "\"messages\" is empty" },
		{ "labelname", "{\"text\": \"a\", \"label\": \"food\"}\n{\"text\": \"b\", \"label\": \"sports\"}\n",
		  TR_ROWS_CLASSIFY, 512, NULL, TD_ERANGE, ":2: ",
		  "label \"sports\" is not in the label set (classify.label_names: computers, science, food)" },
		{ "labelid", "{\"text\": \"a\", \"label\": 3}\n", TR_ROWS_CLASSIFY, 512, NULL, TD_ERANGE, ":1: ",
		  "label 3 is outside the label set 0 .. 2" },
		{ "labeltype", "{\"text\": \"a\", \"label\": 1.5}\n", TR_ROWS_CLASSIFY, 512, NULL, TD_EFORMAT, ":1: ",
		  "expected a label name or an integer id" },
		{ "nolabel", "{\"text\": \"a\"}\n", TR_ROWS_CLASSIFY, 512, NULL, TD_EFORMAT, ":1: ",
		  "no \"label\" field (classify.label_field)" },
		{ "emptytext", "{\"text\": \"\", \"label\": 1}\n", TR_ROWS_CLASSIFY, 512, NULL, TD_EFORMAT, ":1: ",
		  "nothing to classify" },
		{ "vocab", "{\"text\": \"a\"}\n{\"text\": \"Hello, world!\"}\n", TR_ROWS_TEXT, 100, NULL, TD_ERANGE, ":2: ",
		  "is outside the model's vocabulary of 100" },
		{ "template", "{\"messages\": []}\n", TR_ROWS_AUTO, 512, "{role}: {content} {content}", TD_EINVAL,
		  "data.chat_template", "more than once" },
		{ "template2", "{\"messages\": []}\n", TR_ROWS_AUTO, 512, "{user}: {content}", TD_EINVAL,
		  "data.chat_template", "is not a placeholder" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char name[64];
		snprintf(name, sizeof(name), "%s.jsonl", cases[i].name);
		const char *path = tmp_path(name);
		write_file(path, cases[i].body);
		struct tr_data_opts o = jopts(path, 16);
		o.rows = cases[i].rows;
		o.vocab = cases[i].vocab;
		o.chat_template = cases[i].tmpl;
		o.label_names = names;
		o.n_label_names = 3;
		o.num_labels = 3;
		struct tr_data *d = NULL;
		struct td_errbuf eb = { { 0 } };
		td_err e = tr_data_open(&d, &o, &eb);
		CHECK_MSG(e == cases[i].code, "%s: %s, want %s (%s)", cases[i].name, td_errname(e), td_errname(cases[i].code),
			  eb.msg);
		if (!cases[i].tmpl)
			CHECK_CONTAINS(eb.msg, name);
		CHECK_CONTAINS(eb.msg, cases[i].where);
		CHECK_CONTAINS(eb.msg, cases[i].msg);
		CHECK(d == NULL);
	}

	/* Options: classification is never packed; EOS must be a token. */
	const char *path = tmp_path("cls.jsonl");
	struct tr_data_opts o = jopts(path, 16);
	o.rows = TR_ROWS_CLASSIFY;
	o.packing = true;
	struct tr_data *d = NULL;
	struct td_errbuf eb = { { 0 } };
	CHECK_EQ_INT(tr_data_open(&d, &o, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "data.packing: false");
	o = jopts(tmp_path("text.jsonl"), 16);
	o.eos_id = 600;
	CHECK_EQ_INT(tr_data_open(&d, &o, &eb), TD_ERANGE);
	CHECK_CONTAINS(eb.msg, "EOS id 600");

	/* The first bad line of a large file, whatever worker reads it: 3000
	 * rows, bad lines at 1700 and 2900, four workers. */
	path = tmp_path("big.jsonl");
	FILE *f = fopen(path, "w");
	for (int i = 1; i <= 3000; i++)
		fprintf(f, i == 1700 || i == 2900 ? "{\"text\": oops}\n" : "{\"text\": \"line %d of a longer file\"}\n", i);
	fclose(f);
	for (int threads = 1; threads <= 4; threads += 3) {
		o = jopts(path, 16);
		o.threads = threads;
		CHECK_EQ_INT(tr_data_open(&d, &o, &eb), TD_EFORMAT);
		CHECK_CONTAINS(eb.msg, "big.jsonl:1700: not valid JSON");
	}
}

/* ------------------------------------------------------------------------ */
/* Order and the cache */

static void test_order(void)
{
	const char *path = tmp_path("order.jsonl");
	FILE *f = fopen(path, "w");
	for (int i = 0; i < 200; i++)
		fprintf(f, "{\"text\": \"document number %d\"}\n", i);
	fclose(f);
	struct tr_data_opts o = jopts(path, 8);
	o.shuffle = true;
	struct tr_data *a = open_ok(&o), *b = open_ok(&o);
	o.seed = 2;
	struct tr_data *c = open_ok(&o);
	if (!a || !b || !c)
		return;
	uint64_t n = tr_data_num_sequences(a);
	CHECK(n >= 200);
	/* Two epochs, one sequence at a time: a and b agree, c does not; each
	 * epoch visits every sequence once (told apart by their first ids and
	 * an index of sequences in file order). */
	int32_t *plain = malloc(n * 8 * sizeof(int32_t)), lab[8];
	for (uint64_t s = 0; s < n; s++)
		sequence(a, s, plain + s * 8, lab, NULL);
	struct tr_data_pos pa = { 0, 0 }, pb = { 0, 0 }, pc = { 0, 0 };
	bool same_ab = true, same_ac = true, first_epochs_same = true;
	unsigned char *seen = calloc(n, 1);
	uint64_t *first = malloc(n * sizeof(uint64_t));
	struct td_errbuf eb;
	for (uint64_t k = 0; k < 2 * n; k++) {
		int32_t ia[8], ib[8], ic[8], la[8];
		tr_data_next(a, &pa, ia, la, NULL, 1, &eb);
		tr_data_next(b, &pb, ib, la, NULL, 1, &eb);
		tr_data_next(c, &pc, ic, la, NULL, 1, &eb);
		same_ab &= memcmp(ia, ib, sizeof(ia)) == 0;
		same_ac &= memcmp(ia, ic, sizeof(ia)) == 0;
		uint64_t which = n;
		for (uint64_t s = 0; s < n; s++)
			if (memcmp(plain + s * 8, ia, sizeof(ia)) == 0 && !(seen[s] & (1u << (k / n)))) {
				which = s;
				break;
			}
		CHECK_MSG(which < n, "batch %llu is not a sequence of the epoch not yet seen", (unsigned long long)k);
		if (which < n)
			seen[which] |= (unsigned char)(1u << (k / n));
		if (k < n)
			first[k] = which;
		else
			first_epochs_same &= first[k - n] == which;
	}
	CHECK(same_ab);
	CHECK(!same_ac);
	CHECK(!first_epochs_same); /* epoch 1 has its own order */
	CHECK_EQ_INT(pa.epoch, 1);
	CHECK_EQ_INT(pa.index, n);
	for (uint64_t s = 0; s < n; s++)
		CHECK_MSG(seen[s] == 3, "sequence %llu seen %d", (unsigned long long)s, seen[s]);
	/* Resuming at a position gives the batches that followed it. */
	struct tr_data_pos p1 = { 0, 0 };
	int32_t x[4 * 8], y[4 * 8], l[4 * 8];
	for (int k = 0; k < 3; k++)
		tr_data_next(a, &p1, x, l, NULL, 4, &eb);
	struct tr_data_pos saved = p1;
	tr_data_next(a, &p1, x, l, NULL, 4, &eb);
	tr_data_close(a);
	o.seed = 1; /* a's, reopened */
	a = open_ok(&o);
	if (a) {
		tr_data_next(a, &saved, y, l, NULL, 4, &eb);
		CHECK(memcmp(x, y, sizeof(x)) == 0);
		tr_data_close(a);
	}
	free(plain);
	free(seen);
	free(first);
	tr_data_close(b);
	tr_data_close(c);
}

static size_t count_files(const char *dir, const char *suffix)
{
	DIR *d = opendir(dir);
	size_t n = 0;
	struct dirent *de;
	while (d && (de = readdir(d))) {
		size_t l = strlen(de->d_name), k = strlen(suffix);
		n += l > k && strcmp(de->d_name + l - k, suffix) == 0;
	}
	if (d)
		closedir(d);
	return n;
}

static void test_cache(void)
{
	char fort[512];
	snprintf(fort, sizeof(fort), "%s/demo/fortunes.jsonl", fx);
	struct tr_data_opts o = jopts(fort, 64);
	o.packing = true;
	o.cache_dir = tmp_path("cache2");
	char *logbuf = NULL;
	size_t loglen = 0;
	FILE *log = open_memstream(&logbuf, &loglen);
	o.log = log;
	o.threads = 1;
	struct tr_data *one = open_ok(&o);
	fflush(log);
	CHECK_CONTAINS(logbuf, "tokenizing");
	CHECK_CONTAINS(logbuf, "MB/s");
	o.threads = 0;
	struct tr_data *again = open_ok(&o); /* maps the cache */
	fflush(log);
	CHECK_CONTAINS(logbuf, ": token cache ");
	CHECK_EQ_INT(count_files(o.cache_dir, ".tokens"), 1);
	/* four workers build the same cache: remove it and rebuild */
	char cmd[600];
	snprintf(cmd, sizeof(cmd), "rm -f %s/*.rows", o.cache_dir);
	CHECK_EQ_INT(system(cmd), 0);
	o.threads = 4;
	struct tr_data *four = open_ok(&o);
	/* a damaged index is rebuilt, not trusted (made by a copy: the mapped
	 * files of the datasets open here must not change under them) */
	snprintf(cmd, sizeof(cmd), "cd %s && for f in *.rows; do head -c 100 $f > x && mv x $f; done", o.cache_dir);
	CHECK_EQ_INT(system(cmd), 0);
	struct tr_data *rebuilt = open_ok(&o);
	if (one && again && four && rebuilt) {
		CHECK_EQ_INT(tr_data_num_rows(one), 8924);
		CHECK(tr_data_num_sequences(one) == tr_data_num_sequences(four));
		CHECK(tr_data_fingerprint(one) == tr_data_fingerprint(four));
		CHECK(tr_data_fingerprint(one) == tr_data_fingerprint(rebuilt));
		int32_t a[64], b[64], c[64], la[64], lb[64], lc[64];
		bool same = true;
		for (uint64_t s = 0; s < tr_data_num_sequences(one); s++) {
			sequence(one, s, a, la, NULL);
			sequence(four, s, b, lb, NULL);
			sequence(rebuilt, s, c, lc, NULL);
			same &= memcmp(a, b, sizeof(a)) == 0 && memcmp(la, lb, sizeof(la)) == 0 &&
				memcmp(a, c, sizeof(a)) == 0;
		}
		CHECK(same);
	}
	/* another setting that changes tokens: another cache file */
	o.add_special_tokens = false;
	o.eos_id = 1;
	struct tr_data *other = open_ok(&o);
	CHECK_EQ_INT(count_files(o.cache_dir, ".tokens"), 2);
	tr_data_close(other);
	tr_data_close(one);
	tr_data_close(again);
	tr_data_close(four);
	tr_data_close(rebuilt);
	fclose(log);
	free(logbuf);
}

/* The one file in dir ending in suffix, into path (512). */
static bool find_file(const char *dir, const char *suffix, char *path)
{
	DIR *d = opendir(dir);
	struct dirent *de;
	bool found = false;
	while (d && !found && (de = readdir(d))) {
		size_t l = strlen(de->d_name), k = strlen(suffix);
		if (l > k && strcmp(de->d_name + l - k, suffix) == 0) {
			snprintf(path, 512, "%s/%s", dir, de->d_name);
			found = true;
		}
	}
	if (d)
		closedir(d);
	return found;
}

/* A cache whose key matches but whose contents do not fit the job: the user
 * can write their output dir, so this is what a forged (or damaged) cache
 * looks like. Each is rebuilt, never served: an id past the vocabulary would
 * be read past the embedding, a class past the label set past the logits.
 * The first case is fuzz_tokcache's crash, minimized: one byte of row 2's
 * class changed, making it -3585. Offsets: the .rows header is 56 bytes
 * (magic, key, nrow, ntok, source bytes, kind, reserved), then 16 a row
 * (offset, length, class); .tokens is 4 bytes a token. */
static const struct {
	const char *what, *suffix;
	long at;
	uint32_t value;
} forged[] = {
	{ "row 2's class -3585 (fuzz_tokcache)", ".rows", 56 + 16 * 2 + 12, 0xfffff1ffu },
	{ "row 0's class 3 of 3 labels", ".rows", 56 + 12, 3 },
	{ "row 1's class -1 in a classification cache", ".rows", 56 + 16 + 12, 0xffffffffu },
	{ "token 1 is 512, past the vocabulary", ".tokens", 4, 512 },
	{ "token 0 is 600 with the no-loss bit", ".tokens", 0, 0x80000000u | 600 },
	{ "the header's kind is text", ".rows", 48, TR_ROWS_TEXT },
	{ "ntok * 4 wraps to the file's size", ".rows", 36, 0x40000000u },
};

static void test_cache_forged(void)
{
	char path[512], dir[512];
	snprintf(path, sizeof(path), "%s", tmp_path("forged.jsonl"));
	write_file(path, "{\"text\": \"Hello, world!\", \"label\": \"food\"}\n"
			 "{\"text\": \"To teach is to learn.\", \"label\": 0}\n"
			 "{\"label\": \"science\", \"text\": \"The cat sat.\"}\n");
	char *names[] = { "computers", "science", "food" };
	static const int classes[] = { 2, 0, 1 };
	for (size_t i = 0; i < sizeof(forged) / sizeof(forged[0]); i++) {
		snprintf(dir, sizeof(dir), "%s/cache-forged-%zu", tmp, i);
		struct tr_data_opts o = jopts(path, 8);
		o.rows = TR_ROWS_CLASSIFY;
		o.label_names = names;
		o.n_label_names = 3;
		o.num_labels = 3;
		o.truncate = true;
		o.cache_dir = dir;
		struct tr_data *d = open_ok(&o);
		tr_data_close(d);
		char file[512];
		CHECK_MSG(find_file(o.cache_dir, forged[i].suffix, file), "%s: no %s file", forged[i].what,
			  forged[i].suffix);
		FILE *f = fopen(file, "r+b");
		CHECK(f && fseek(f, forged[i].at, SEEK_SET) == 0 && fwrite(&forged[i].value, 4, 1, f) == 1);
		if (f)
			fclose(f);

		char *logbuf = NULL;
		size_t loglen = 0;
		FILE *log = open_memstream(&logbuf, &loglen);
		o.log = log;
		d = open_ok(&o);
		fclose(log);
		CHECK_MSG(logbuf && strstr(logbuf, "tokenizing"), "%s: the cache was not rebuilt: %s", forged[i].what,
			  logbuf ? logbuf : "");
		for (uint64_t s = 0; d && s < tr_data_num_sequences(d); s++) {
			int32_t ids[8], labels[8], cls = -7;
			sequence(d, s, ids, labels, &cls);
			CHECK_MSG(cls == classes[s], "%s: sequence %llu: class %d, want %d", forged[i].what,
				  (unsigned long long)s, cls, classes[s]);
			for (int t = 0; t < 8; t++)
				CHECK_MSG(ids[t] >= 0 && ids[t] < 512, "%s: sequence %llu: id %d", forged[i].what,
					  (unsigned long long)s, ids[t]);
		}
		tr_data_close(d);
		free(logbuf);
	}
}

/* ------------------------------------------------------------------------ */
/* The trainer on JSONL */

static Traind__JobSpec *job(const char *name, const char *model, const char *train, const char *eval)
{
	Traind__JobSpec *s = rpc_jobspec_new();
	s->name = strdup(name);
	s->model_dir = strdup(model);
	struct td_errbuf eb = { { 0 } };
	rpc_jobspec_apply_defaults(s, &eb);
	free(s->data->train_file);
	s->data->train_file = strdup(train);
	if (eval)
		s->data->eval_file = strdup(eval);
	free(s->output->dir);
	char out[512];
	snprintf(out, sizeof(out), "%s/%s", tmp, name);
	s->output->dir = strdup(out);
	s->data->format = TRAIND__DATA_FORMAT__DATA_FORMAT_JSONL;
	s->data->seq_len = 32;
	s->data->has_eos_id = 1;
	s->data->eos_id = 0;
	s->hyper->lr = 1e-3;
	s->hyper->schedule = TRAIND__SCHEDULE__SCHEDULE_CONSTANT;
	s->hyper->has_max_steps = 1;
	s->hyper->max_steps = 6;
	s->hyper->has_epochs = 0;
	s->hyper->micro_batch = 2;
	s->hyper->seed = 7;
	s->output->checkpoint_every = 3;
	s->resources->device = TRAIND__DEVICE__DEVICE_CPU;
	s->hyper->has_precision = 1;
	s->hyper->precision = TRAIND__PRECISION__PRECISION_FP32;
	if (rpc_jobspec_validate(s, &eb) != TD_OK) {
		fprintf(stderr, "spec %s: %s\n", name, eb.msg);
		exit(2);
	}
	return s;
}

static td_err train(const Traind__JobSpec *s, uint64_t stop_after, struct tr_train_result *r, FILE *log,
		    struct td_errbuf *eb)
{
	struct tr_train_opts o = { .backend = "cpu", .stop_after = stop_after, .log = log };
	return tr_train(s, &o, NULL, r, eb);
}

static int diff_models(const char *a, const char *b)
{
	struct tr_weights *wa = NULL, *wb = NULL;
	struct td_errbuf eb = { { 0 } };
	if (tr_weights_open(&wa, a, &eb) || tr_weights_open(&wb, b, &eb)) {
		fprintf(stderr, "diff_models: %s\n", eb.msg);
		tr_weights_close(wa);
		return -1;
	}
	int ndiff = tr_weights_count(wa) != tr_weights_count(wb);
	for (size_t i = 0; i < tr_weights_count(wa); i++) {
		const struct tr_st_tensor *ta = tr_weights_at(wa, i), *tb = tr_weights_find(wb, ta->name);
		ndiff += !tb || tb->nbytes != ta->nbytes || memcmp(ta->data, tb->data, ta->nbytes) != 0;
	}
	tr_weights_close(wa);
	tr_weights_close(wb);
	return ndiff;
}

static void test_trainer(void)
{
	char model[512], data[512], eval[512];
	snprintf(model, sizeof(model), "%s/qwen2", fx);
	snprintf(data, sizeof(data), "%s/pc-train.jsonl", tmp);
	snprintf(eval, sizeof(eval), "%s/pc-eval.jsonl", tmp);
	/* prompt/completion rows from the demo's fortunes */
	char src[512];
	snprintf(src, sizeof(src), "%s/demo/fortunes.jsonl", fx);
	FILE *in = fopen(src, "r"), *out = fopen(data, "w"), *ev = fopen(eval, "w");
	char line[8192];
	for (int i = 0; i < 120 && fgets(line, sizeof(line), in); i++) {
		struct json_object *o = json_tokener_parse(line), *t;
		if (!o || !json_object_object_get_ex(o, "text", &t)) {
			json_object_put(o);
			continue;
		}
		const char *s = json_object_get_string(t);
		size_t n = strlen(s), cut = n / 3;
		char *p = strndup(s, cut);
		struct json_object *r = json_object_new_object();
		json_object_object_add(r, "prompt", json_object_new_string(p));
		json_object_object_add(r, "completion", json_object_new_string(s + cut));
		fprintf(i < 100 ? out : ev, "%s\n", json_object_to_json_string_ext(r, JSON_C_TO_STRING_PLAIN));
		json_object_put(r);
		json_object_put(o);
		free(p);
	}
	fclose(in);
	fclose(out);
	fclose(ev);

	/* A resumed run continues with the next batch: bit for bit the same as
	 * an uninterrupted one, and the token cache is not rebuilt. */
	Traind__JobSpec *straight = job("straight", model, data, NULL), *resumed = job("resumed", model, data, NULL);
	struct tr_train_result r1, r2, r3;
	struct td_errbuf eb = { { 0 } };
	CHECK_MSG(train(straight, 0, &r1, NULL, &eb) == TD_OK, "%s", eb.msg);
	CHECK_EQ_INT(r1.steps_done, 6);
	CHECK(r1.first_loss > 0);
	CHECK_MSG(train(resumed, 3, &r2, NULL, &eb) == TD_OK, "%s", eb.msg);
	CHECK(r2.stopped);
	char *logbuf = NULL;
	size_t loglen = 0;
	FILE *log = open_memstream(&logbuf, &loglen);
	CHECK_MSG(train(resumed, 0, &r3, log, &eb) == TD_OK, "%s", eb.msg);
	fclose(log);
	CHECK_EQ_INT(r3.resumed_from, 3);
	CHECK_CONTAINS(logbuf, ": token cache ");
	CHECK(logbuf && strstr(logbuf, "tokenizing") == NULL);
	free(logbuf);
	CHECK_MSG(r3.last_loss == r1.last_loss, "final loss %.9g vs %.9g", r3.last_loss, r1.last_loss);
	char a[512], b[512];
	snprintf(a, sizeof(a), "%s/straight", tmp);
	snprintf(b, sizeof(b), "%s/resumed", tmp);
	CHECK_EQ_INT(diff_models(a, b), 0);

	/* Other data under the same output: refused, naming the checkpoint. */
	Traind__JobSpec *other = job("other", model, data, NULL);
	CHECK_EQ_INT(train(other, 3, &r2, NULL, &eb), TD_OK);
	other->data->overflow = TRAIND__OVERFLOW__OVERFLOW_TRUNCATE;
	other->data->packing = 0;
	CHECK_EQ_INT(train(other, 0, &r2, NULL, &eb), TD_EMISMATCH);
	CHECK_CONTAINS(eb.msg, "the data differs");
	rpc_jobspec_free(other);

	/* Bad data fails the job before the model is loaded: this model dir has
	 * no weights, and the error is the data's. */
	char nomodel[512], cmd[1200], bad[512];
	snprintf(nomodel, sizeof(nomodel), "%s/noweights", tmp);
	snprintf(cmd, sizeof(cmd), "mkdir -p %s && cp %s/config.json %s/tokenizer.json %s/", nomodel, model, model,
		 nomodel);
	CHECK_EQ_INT(system(cmd), 0);
	snprintf(bad, sizeof(bad), "%s/bad.jsonl", tmp);
	write_file(bad, "{\"text\": \"fine\"}\n{\"text\": \"fine\"}\n{\"text\" \"not fine\"}\n");
	Traind__JobSpec *bj = job("bad", nomodel, bad, NULL);
	CHECK_EQ_INT(train(bj, 0, &r2, NULL, &eb), TD_EFORMAT);
	CHECK_CONTAINS(eb.msg, "bad.jsonl:3: not valid JSON");
	rpc_jobspec_free(bj);

	/* The eval loss: the final model's mean loss over the eval file,
	 * checked by a forward pass over its sequences here. */
	Traind__JobSpec *ej = job("eval", model, data, eval);
	CHECK_MSG(train(ej, 0, &r2, NULL, &eb) == TD_OK, "%s", eb.msg);
	CHECK(isfinite(r2.eval_loss) && r2.eval_loss > 0);
	struct tr_data *ed = NULL;
	struct tr_model_config cfg;
	char cfgpath[600], outdir[600];
	snprintf(cfgpath, sizeof(cfgpath), "%s/eval/config.json", tmp);
	snprintf(outdir, sizeof(outdir), "%s/eval", tmp);
	CHECK_EQ_INT(tr_config_load(&cfg, cfgpath, &eb), TD_OK);
	CHECK_MSG(tr_data_open_job(&ed, ej, &cfg, true, NULL, &eb) == TD_OK, "%s", eb.msg);
	struct gpu_backend *be = NULL;
	struct tr_model *m = NULL;
	struct tr_weights *w = NULL;
	gpu_cpu_backend_new(&be, &eb);
	struct tr_plan_opts po = { .B = 1, .T = 32 };
	if (ed && tr_model_new(&m, be, &cfg, &po, &eb) == TD_OK && tr_weights_open(&w, outdir, &eb) == TD_OK &&
	    tr_model_load(m, w, &eb) == TD_OK) {
		double sum = 0;
		int64_t count = 0;
		for (uint64_t s = 0; s < tr_data_num_sequences(ed); s++) {
			int32_t ids[32], labels[32];
			double ls;
			int64_t nv;
			sequence(ed, s, ids, labels, NULL);
			CHECK_EQ_INT(tr_model_forward(m, ids, labels, &ls, &nv, &eb), TD_OK);
			sum += ls;
			count += nv;
		}
		CHECK(count > 0);
		/* the evaluation ran its batch through GEMMs of another shape */
		CHECK_NEAR(r2.eval_loss, sum / (double)count, F32_FORWARD_RTOL * r2.eval_loss);
	} else {
		CHECK_MSG(0, "eval check: %s", eb.msg);
	}
	tr_weights_close(w);
	tr_model_free(m);
	gpu_backend_free(be);
	tr_data_close(ed);
	rpc_jobspec_free(ej);
	rpc_jobspec_free(straight);
	rpc_jobspec_free(resumed);
}

/* ------------------------------------------------------------------------ */
/* The job spec's data fields */

static void test_spec(void)
{
	struct td_errbuf eb = { { 0 } };
	/* defaults: full packs and splits; classify pads and truncates */
	Traind__JobSpec *s = rpc_jobspec_new();
	s->model_dir = strdup("/m/qwen2");
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	CHECK(s->data->packing);
	CHECK_EQ_INT(s->data->overflow, TRAIND__OVERFLOW__OVERFLOW_SPLIT);
	CHECK(!s->data->has_rows);
	CHECK_STR_EQ(s->data->chat_template, TR_CHATML_TEMPLATE);
	CHECK_STR_EQ(s->data->messages_field, "messages");
	CHECK(s->data->assistant_only_loss && s->data->add_special_tokens);
	rpc_jobspec_free(s);
	s = rpc_jobspec_new();
	s->model_dir = strdup("/m/qwen2");
	s->method = TRAIND__METHOD__METHOD_CLASSIFY;
	s->has_method = 1;
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK);
	CHECK(!s->data->packing);
	CHECK_EQ_INT(s->data->overflow, TRAIND__OVERFLOW__OVERFLOW_TRUNCATE);
	CHECK_EQ_INT(rpc_jobspec_apply_defaults(s, &eb), TD_OK); /* idempotent */
	CHECK(!s->data->packing);
	rpc_jobspec_free(s);

	static const struct {
		const char *what;
		int method; /* 0 full, 1 classify */
		const char *file;
		const char *tmpl;
		int packing; /* -1 unset */
		int overflow;
		int rows;
		uint64_t eval_every;
		const char *msg;
	} cases[] = {
		{ "ok", 0, "/d/a.jsonl", NULL, -1, 0, 0, 0, NULL },
		{ "ok classify", 1, "/d/a.jsonl", NULL, -1, 0, 0, 0, NULL },
		{ "no content", 0, "/d/a.jsonl", "{role}", -1, 0, 0, 0, "data.chat_template: needs {content} exactly once" },
		{ "brace", 0, "/d/a.jsonl", "{who} {content}", -1, 0, 0, 0,
		  "data.chat_template: '{' at byte 0 is not a placeholder" },
		{ "classify packing", 1, "/d/a.jsonl", NULL, 1, 0, 0, 0, "data.packing: method CLASSIFY needs one row a sequence" },
		{ "classify split", 1, "/d/a.jsonl", NULL, -1, TRAIND__OVERFLOW__OVERFLOW_SPLIT, 0, 0,
		  "data.overflow: method CLASSIFY truncates" },
		{ "tokens padding", 0, "/d/a.tokens", NULL, 0, 0, 0, 0, "data.packing: false needs JSONL" },
		{ "tokens rows", 0, "/d/a.tokens", NULL, -1, 0, TRAIND__ROW_FORMAT__ROWS_TEXT, 0, "data.rows: set for a token file" },
		{ "rows enum", 0, "/d/a.jsonl", NULL, -1, 0, 9, 0, "data.rows: unknown value 9" },
		{ "eval_every", 0, "/d/a.jsonl", NULL, -1, 0, 0, 10, "data.eval_every: set, but there is no data.eval_file" },
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		s = rpc_jobspec_new();
		s->model_dir = strdup("/m/qwen2");
		s->data = malloc(sizeof(*s->data));
		traind__data_spec__init(s->data);
		s->data->train_file = strdup(cases[i].file);
		s->output = malloc(sizeof(*s->output));
		traind__output_spec__init(s->output);
		s->output->dir = strdup("/o");
		if (cases[i].method) {
			s->method = TRAIND__METHOD__METHOD_CLASSIFY;
			s->has_method = 1;
			s->classify = malloc(sizeof(*s->classify));
			traind__classify_spec__init(s->classify);
			s->classify->num_labels = 3;
			s->classify->has_num_labels = 1;
		}
		if (cases[i].tmpl)
			s->data->chat_template = strdup(cases[i].tmpl);
		if (cases[i].packing >= 0) {
			s->data->packing = cases[i].packing;
			s->data->has_packing = 1;
		}
		if (cases[i].overflow) {
			s->data->overflow = cases[i].overflow;
			s->data->has_overflow = 1;
		}
		if (cases[i].rows) {
			s->data->rows = cases[i].rows;
			s->data->has_rows = 1;
		}
		if (cases[i].eval_every) {
			s->data->eval_every = cases[i].eval_every;
			s->data->has_eval_every = 1;
		}
		memset(eb.msg, 0, sizeof(eb.msg));
		td_err e = rpc_jobspec_validate(s, &eb);
		if (cases[i].msg) {
			CHECK_MSG(e == TD_EINVAL, "%s: %s", cases[i].what, td_errname(e));
			CHECK_CONTAINS(eb.msg, cases[i].msg);
		} else {
			CHECK_MSG(e == TD_OK, "%s: %s", cases[i].what, eb.msg);
		}
		rpc_jobspec_free(s);
	}
}

int main(void)
{
	fx = getenv("TD_FIXTURES");
	if (!fx)
		return check_skip("TD_FIXTURES is not set (run through meson test)");
	snprintf(tmp, sizeof(tmp), "/tmp/td-data-XXXXXX");
	if (!mkdtemp(tmp)) {
		perror("mkdtemp");
		return 2;
	}
	char path[512];
	snprintf(path, sizeof(path), "%s/tokenizer/tokenizer.json", fx);
	struct td_errbuf eb = { { 0 } };
	if (tr_tokenizer_load(&tok, path, &eb) || tr_encoder_new(&enc, tok, &eb)) {
		fprintf(stderr, "%s\n", eb.msg);
		return 2;
	}
	test_prompt_masks();
	test_layouts();
	test_messages();
	test_classify();
	test_errors();
	test_order();
	test_cache();
	test_cache_forged();
	test_trainer();
	test_spec();

	tr_encoder_free(enc);
	tr_tokenizer_free(tok);
	char cmd[600];
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", tmp);
	if (!check_failures_ && system(cmd) != 0)
		fprintf(stderr, "could not remove %s\n", tmp);
	return check_status();
}
