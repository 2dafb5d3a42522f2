/* The choice of a job's GPUs (daemon/placement.h). */
#include "daemon/placement.h"

#include <stddef.h>

int dmn_place_nvlink_pairs(uint32_t mask, const uint32_t *links, int ng)
{
	if (!links)
		return 0;
	int twice = 0;
	for (int i = 0; i < ng; i++)
		if (mask >> i & 1)
			twice += __builtin_popcount(links[i] & mask & ~((uint32_t)1 << i));
	return twice / 2;
}

/* Whether set a comes before set b in index order: its lowest GPU that the
 * other lacks is lower. */
static bool lower_indices(uint32_t a, uint32_t b)
{
	uint32_t x = a ^ b;
	return x && (a & x & -x);
}

uint32_t dmn_place_pick(const struct dmn_place_gpu *g, int ng, const uint32_t *links, int n,
			enum dmn_place_when when)
{
	if (ng < 0 || ng > DMN_PLACE_MAX || n < 1 || n > ng)
		return 0;
	/* The GPUs that qualify on their own, as a list. */
	int cand[DMN_PLACE_MAX], m = 0;
	for (int i = 0; i < ng; i++) {
		if (!g[i].usable)
			continue;
		if (when == DMN_PLACE_NOW ? g[i].need > g[i].avail : g[i].need > g[i].share)
			continue;
		cand[m++] = i;
	}
	if (m < n)
		return 0;
	uint32_t best = 0;
	int best_pairs = -1;
	uint64_t best_avail = 0;
	/* Every subset of n candidates, in increasing order of bits (Gosper). */
	for (uint32_t bits = ((uint32_t)1 << n) - 1; bits < ((uint32_t)1 << m);) {
		uint32_t mask = 0;
		uint64_t avail = 0;
		for (int k = 0; k < m; k++) {
			if (bits >> k & 1) {
				mask |= (uint32_t)1 << cand[k];
				uint64_t a = g[cand[k]].avail;
				avail = avail > UINT64_MAX - a ? UINT64_MAX : avail + a;
			}
		}
		int pairs = dmn_place_nvlink_pairs(mask, links, ng);
		bool better;
		if (!best || pairs != best_pairs)
			better = !best || pairs > best_pairs;
		else if (when == DMN_PLACE_EMPTY && avail != best_avail)
			better = avail > best_avail;
		else
			better = lower_indices(mask, best);
		if (better) {
			best = mask;
			best_pairs = pairs;
			best_avail = avail;
		}
		uint32_t c = bits & -bits, r = bits + c;
		bits = (((r ^ bits) >> 2) / c) | r;
	}
	return best;
}
