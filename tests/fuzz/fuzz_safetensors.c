/* libFuzzer target: a model dir's weights as train/modeldir.c reads them — one
 * model.safetensors, or a model.safetensors.index.json and its shards — then
 * every tensor that opened converted to float and int (train/safetensors.h).
 *
 * Input: bytes that start with '{' are an index: the input is cut at
 * "|SHARD|" into the index JSON and the shards a.safetensors, b.safetensors,
 * c.safetensors, ... (the index names them). Anything else is the one
 * model.safetensors. Each run writes its files into a fresh scratch dir.
 *
 * What must hold besides no crash, leak or UB: whatever opens lies inside its
 * file (the data of every tensor is readable end to end, which ASan checks
 * against the mapping's size through the conversions), and tr_weights_find
 * finds every tensor by its name. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz_util.h"
#include "train/modeldir.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void read_all(const struct tr_weights *w)
{
	struct td_errbuf eb;
	for (size_t i = 0; i < tr_weights_count(w); i++) {
		const struct tr_st_tensor *t = tr_weights_at(w, i);
		if (tr_weights_find(w, t->name) != t || !tr_weights_file_of(w, t->name))
			__builtin_trap();
		if ((size_t)t->numel * tr_dtype_size(t->dtype) != t->nbytes)
			__builtin_trap();
		/* The bytes are in the file (nbytes <= its size): so is numel. */
		float *f = malloc((size_t)t->numel * sizeof(float) + 1);
		int32_t *n = malloc((size_t)t->numel * sizeof(int32_t) + 1);
		if (f && n && tr_st_to_f32(f, t, &eb) != TD_OK)
			tr_st_to_i32(n, t, &eb);
		free(f);
		free(n);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	const char *dir = fuzz_dir();
	char path[PATH_MAX];
	fuzz_clear_dir(dir);
	if (size && data[0] == '{') {
		const uint8_t *at = data, *part;
		size_t len;
		fuzz_next_part(&at, data + size, "|SHARD|", &part, &len);
		fuzz_write(fuzz_path(path, "model.safetensors.index.json"), part, len);
		char name[] = "a.safetensors";
		while (name[0] <= 'z' && fuzz_next_part(&at, data + size, "|SHARD|", &part, &len)) {
			fuzz_write(fuzz_path(path, name), part, len);
			name[0]++;
		}
	} else {
		fuzz_write(fuzz_path(path, "model.safetensors"), data, size);
	}
	struct tr_weights *w = NULL;
	struct td_errbuf eb = {{0}};
	if (tr_weights_open(&w, dir, &eb) == TD_OK) {
		read_all(w);
		tr_weights_close(w);
	} else if (!eb.msg[0]) {
		__builtin_trap(); /* an error must say what is wrong */
	}
	return 0;
}
