/* Inside train/'s datasets (not an API): JSONL rows to tokens (jsonl.c), the
 * token cache (tokcache.c), shared with data.c. See train/data.h for the
 * formats and the rules. */
#ifndef TRAIN_ROWS_H
#define TRAIN_ROWS_H

#include <json-c/json.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto/err.h"
#include "train/data.h"
#include "train/tokenizer.h"

/* Bit 31 of a cached token: no loss at this position (labels -100). */
#define TR__NOLOSS 0x80000000u

/* How rows become tokens: the options, the resolved kind, the parsed chat
 * template. Read-only once made: shared by the workers. */
struct tr__tpl_part {
	bool role; /* else the literal s[0 .. n) */
	const char *s;
	size_t n;
};

struct tr__rowfmt {
	const struct tr_data_opts *o;
	enum tr_rows kind;
	char *lits;                       /* the template's literals, unescaped */
	struct tr__tpl_part *head, *foot; /* before and after {content} */
	size_t nhead, nfoot;
	bool suffix_has_eos;              /* add_special_tokens already ends a text in EOS */
};

/* Parses the template and checks the options (TD_EINVAL naming the data.*
 * field). kind stays o->rows (TR_ROWS_AUTO until tr__rowfmt_detect). */
td_err tr__rowfmt_init(struct tr__rowfmt *f, const struct tr_data_opts *o, struct td_errbuf *eb);
void tr__rowfmt_fini(struct tr__rowfmt *f);
/* Decides an AUTO kind from one row; msg gets what is wrong (no file:line). */
td_err tr__rowfmt_detect(struct tr__rowfmt *f, const char *line, size_t len, char *msg, size_t cap);

/* Per worker: an encoder, a JSON parser, scratch. */
struct tr__rowctx {
	const struct tr__rowfmt *f;
	struct tr_encoder *enc;
	json_tokener *jt;
	struct tr_ids part;
	char *buf;
	size_t bufcap;
};

td_err tr__rowctx_init(struct tr__rowctx *c, const struct tr__rowfmt *f, struct td_errbuf *eb);
void tr__rowctx_fini(struct tr__rowctx *c);

/* One JSONL line (without its newline) to tokens, appended to out with
 * TR__NOLOSS on positions without loss; *cls its class or -1. A line of only
 * whitespace is not a row: *blank is set and nothing is appended. On a bad row
 * TD_EFORMAT / TD_ERANGE / TD_ENOMEM with msg saying what (the caller adds the
 * file and line). */
td_err tr__row(struct tr__rowctx *c, const char *line, size_t len, struct tr_ids *out, int32_t *cls, bool *blank,
	       char *msg, size_t cap);

/* One row of the cache index. */
struct tr__rowent {
	uint64_t off; /* first token */
	uint32_t len;
	int32_t cls;  /* class, or -1 */
};

/* A token cache, mapped. */
struct tr__cache {
	const uint32_t *tok;
	uint64_t ntok;
	const struct tr__rowent *row;
	uint64_t nrow;
	uint64_t key[2];
	void *tok_map, *row_map;
	size_t tok_map_len, row_map_len;
};

/* Maps the cache of o (a JSONL dataset) if it is there and sound, else
 * tokenizes the file into it (worker threads) and maps that. Errors name the
 * file and line. */
td_err tr__cache_open(struct tr__cache *c, const struct tr_data_opts *o, struct td_errbuf *eb);
void tr__cache_close(struct tr__cache *c);

#endif
