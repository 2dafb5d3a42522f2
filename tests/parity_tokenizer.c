/* parity for a tokenizer fixture: comes with the text issue (tokenizer.json). */
#include <stdio.h>

#include "tests/parity.h"

int parity_tokenizer(const struct parity_opts *o)
{
	fprintf(stderr, "parity: %s: tokenizer fixtures need the tokenizer, which this build does not have yet\n",
		o->dir);
	return 2;
}
