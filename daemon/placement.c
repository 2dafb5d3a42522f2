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

/* What victims v[pick[0 .. np)] but skip free on GPU i. */
static int64_t freed_on(const struct dmn_place_victim *v, const size_t *pick, size_t np, size_t skip,
			int i)
{
	int64_t f = 0;
	for (size_t m = 0; m < np; m++) {
		if (m == skip)
			continue;
		for (int g = 0; g < v[pick[m]].ngpus; g++)
			if (v[pick[m]].gpu[g] == i)
				f += (int64_t)v[pick[m]].bytes[g];
	}
	return f;
}

size_t dmn_place_victims(const struct dmn_place_victim *v, size_t nv, int ng, uint32_t mask,
			 const int64_t *need, const int64_t *base, size_t *pick)
{
	if (ng > DMN_PLACE_MAX)
		return 0;
	int64_t deficit[DMN_PLACE_MAX] = {0};
	bool short_any = false;
	for (int i = 0; i < ng; i++)
		if (mask >> i & 1 && need[i] > base[i])
			deficit[i] = need[i] - base[i], short_any = true;
	size_t np = 0;
	for (size_t k = 0; k < nv && short_any; k++) {
		bool helps = false;
		for (int g = 0; g < v[k].ngpus; g++) {
			int i = v[k].gpu[g];
			helps = helps || (i >= 0 && i < ng && mask >> i & 1 &&
					  freed_on(v, pick, np, SIZE_MAX, i) < deficit[i]);
		}
		if (!helps)
			continue;
		pick[np++] = k;
		short_any = false;
		for (int i = 0; i < ng; i++)
			short_any = short_any || (mask >> i & 1 && freed_on(v, pick, np, SIZE_MAX, i) < deficit[i]);
	}
	if (short_any)
		return 0;
	/* Drop, the last taken first, each victim the others cover. */
	for (size_t k = np; k-- > 0;) {
		bool covered = true;
		for (int i = 0; i < ng && covered; i++)
			if (mask >> i & 1 && deficit[i] > 0)
				covered = freed_on(v, pick, np, k, i) >= deficit[i];
		if (covered) {
			for (size_t m = k; m + 1 < np; m++)
				pick[m] = pick[m + 1];
			np--;
		}
	}
	return np;
}
