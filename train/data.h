/* Training data: token files, packed into fixed-length sequences, visited in
 * a deterministic shuffled order.
 *
 * Token file format: little-endian uint32 token ids, nothing else; documents
 * are separated by the EOS id. The stream is cut into sequences of T tokens
 * (the tail shorter than T is dropped); labels equal the ids (the model
 * shifts them). Sequence order in epoch e is a Fisher-Yates permutation drawn
 * from splitmix64 seeded by (seed, e): a function of the seed and the epoch
 * only, so a data position (epoch, index) is all a checkpoint needs to resume.
 *
 * JSONL comes with the text issue. This is not a tokenizer. */
#ifndef TRAIN_DATA_H
#define TRAIN_DATA_H

#include <stdint.h>

#include "proto/err.h"

struct tr_data;

struct tr_data_pos {
	uint64_t epoch;
	uint64_t index; /* next sequence within the epoch's order */
};

/* Maps path and checks it: size a multiple of 4, every id < vocab (the error
 * names the token index and byte offset), at least one sequence of T. */
td_err tr_data_open_tokens(struct tr_data **out, const char *path, int T, int vocab, uint64_t seed,
			   struct td_errbuf *eb);
void tr_data_close(struct tr_data *d);

uint64_t tr_data_num_sequences(const struct tr_data *d);
uint64_t tr_data_num_tokens(const struct tr_data *d);

/* Fills B rows of ids and labels (B, T) from *pos and advances it, rolling
 * into the next epoch (with its own order) when this one runs out. */
td_err tr_data_next(struct tr_data *d, struct tr_data_pos *pos, int32_t *ids, int32_t *labels,
		    int B, struct td_errbuf *eb);

#endif
