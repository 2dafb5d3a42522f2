/* parity for LoRA, classification and distillation fixtures: comes with the methods issue. */
#include <stdio.h>

#include "tests/parity.h"

int parity_methods(const struct parity_opts *o)
{
	fprintf(stderr, "parity: %s: LoRA, classification and distillation need the methods, which this build does not have yet\n",
		o->dir);
	return 2;
}
