/* libFuzzer target: the token cache's files as a resumed job finds them
 * (train/tokcache.c): <key>.rows (the header and the row index) and
 * <key>.tokens, which the job maps instead of tokenizing again when they
 * agree with its key. The cache lies in the job's output dir, which its user
 * can write: whatever is there must be refused (and rebuilt) or be safe to
 * serve.
 *
 * The check that decides is static (cache_map), so this file includes
 * tokcache.c rather than linking it; nothing else of it is called.
 *
 * Input: one byte whose bit 0 makes the job's dataset a classification one
 * (else text), the .rows file, "|TOKENS|", the .tokens file. The job's key
 * is fixed (KEY0, KEY1 below: the seeds carry it), its vocabulary 512, its
 * label set 3.
 *
 * What must hold besides no crash, leak or UB: a cache that maps serves rows
 * that tile the tokens, every id below the vocabulary and every class in the
 * label set (classification) or -1 (causal). */
#include "train/tokcache.c"

#include "tests/fuzz/fuzz_util.h"

#define KEY0 0x746472616964636bull /* "kcdiardt" */
#define KEY1 0x313230327a7a7566ull /* "fuzz2021" */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char rows[PATH_MAX], toks[PATH_MAX];
	fuzz_path(rows, "k.rows");
	fuzz_path(toks, "k.tokens");
	if (size < 1)
		return 0;
	bool classify = data[0] & 1;
	const uint8_t *at = data + 1, *part;
	size_t len;
	fuzz_next_part(&at, data + size, "|TOKENS|", &part, &len);
	fuzz_write(rows, part, len);
	if (fuzz_next_part(&at, data + size, "|TOKENS|", &part, &len))
		fuzz_write(toks, part, len);
	else
		unlink(toks);
	struct tr_data_opts o = {
		.path = "data.jsonl",
		.jsonl = true,
		.vocab = 512,
		.rows = classify ? TR_ROWS_CLASSIFY : TR_ROWS_TEXT,
		.num_labels = 3,
	};
	const uint64_t key[2] = { KEY0, KEY1 };
	struct tr__cache c;
	if (!cache_map(&c, &o, o.rows, toks, rows, key))
		return 0;
	uint64_t next = 0;
	for (uint64_t r = 0; r < c.nrow; r++) {
		if (c.row[r].off != next || c.row[r].len == 0)
			__builtin_trap();
		next += c.row[r].len;
		if (classify ? c.row[r].cls < 0 || c.row[r].cls >= o.num_labels : c.row[r].cls != -1) {
			fprintf(stderr, "row %llu: class %d\n", (unsigned long long)r, c.row[r].cls);
			__builtin_trap();
		}
	}
	if (next != c.ntok)
		__builtin_trap();
	for (uint64_t i = 0; i < c.ntok; i++)
		if ((c.tok[i] & ~TR__NOLOSS) >= (uint32_t)o.vocab) {
			fprintf(stderr, "token %llu: id %u\n", (unsigned long long)i, c.tok[i] & ~TR__NOLOSS);
			__builtin_trap();
		}
	tr__cache_close(&c);
	return 0;
}
