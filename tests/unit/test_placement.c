/* The choice of a job's GPUs (daemon/placement.h): a table of hosts and
 * jobs, each with the set it must get; and a table of preemptions, each with
 * the victims it must stop. GPUs are described by what the ledger
 * could grant on each (avail), what it could grant empty (share) and the
 * job's need; links are NVLink pairs. */
#include "daemon/placement.h"

#include <stdint.h>

#include "tests/check.h"

#define B(i) ((uint32_t)1 << (i))

struct pcase {
	const char *what;
	int ng, n;
	enum dmn_place_when when;
	uint64_t avail[DMN_PLACE_MAX]; /* 0 entries beyond ng */
	uint32_t unusable;             /* mask */
	const char *links;             /* groups "0+1,2+3" (every pair of a group joined), NULL: none */
	uint32_t want;
};

enum { NEED = 6, SHARE = 10 };

static const struct pcase cases[] = {
	{"one GPU: the first that fits", 4, 1, DMN_PLACE_NOW, {10, 10, 10, 10}, 0, "0+1,2+3", B(0)},
	{"one GPU: the first that fits, GPU 0 full", 4, 1, DMN_PLACE_NOW, {0, 10, 10, 10}, 0,
	 "0+1,2+3", B(1)},
	{"two: a joined pair", 4, 2, DMN_PLACE_NOW, {10, 10, 10, 10}, 0, "0+1,2+3", B(0) | B(1)},
	{"two: the joined pair 2+3 over 1+2 when 0 is full", 4, 2, DMN_PLACE_NOW, {0, 10, 10, 10}, 0,
	 "0+1,2+3", B(2) | B(3)},
	{"two: no links, the lowest that fit", 4, 2, DMN_PLACE_NOW, {0, 10, 10, 10}, 0, NULL,
	 B(1) | B(2)},
	{"two: unjoined when no joined pair fits", 4, 2, DMN_PLACE_NOW, {0, 10, 10, 0}, 0, "0+1,2+3",
	 B(1) | B(2)},
	{"two: an unusable GPU is skipped", 4, 2, DMN_PLACE_NOW, {10, 10, 10, 10}, B(1), "0+1,2+3",
	 B(2) | B(3)},
	{"two: a GPU with less than the need does not fit", 4, 2, DMN_PLACE_NOW, {5, 10, 10, 5}, 0,
	 "0+1,2+3", B(1) | B(2)},
	{"two: exactly the need fits", 4, 2, DMN_PLACE_NOW, {6, 6, 0, 0}, 0, NULL, B(0) | B(1)},
	{"four: all", 4, 4, DMN_PLACE_NOW, {10, 10, 10, 10}, 0, "0+1,2+3", 0xf},
	{"four: one full, none", 4, 4, DMN_PLACE_NOW, {10, 10, 0, 10}, 0, "0+1,2+3", 0},
	{"four: one full, but empty it fits", 4, 4, DMN_PLACE_EMPTY, {10, 10, 0, 10}, 0, "0+1,2+3",
	 0xf},
	{"wait for two: the joined pair nearest to fitting", 4, 2, DMN_PLACE_EMPTY, {4, 10, 0, 10}, 0,
	 "0+1,2+3", B(0) | B(1)},
	{"wait for two: ties go to the lowest", 4, 2, DMN_PLACE_EMPTY, {0, 0, 0, 0}, 0, "0+1,2+3",
	 B(0) | B(1)},
	{"wait for two: joined beats nearer", 4, 2, DMN_PLACE_EMPTY, {0, 10, 10, 0}, 0, "0+1,2+3",
	 B(0) | B(1)},
	{"wait: unusable GPUs are skipped", 4, 2, DMN_PLACE_EMPTY, {0, 0, 0, 0}, B(0), "0+1,2+3",
	 B(2) | B(3)},
	{"eight: four of a joined group of four", 8, 4, DMN_PLACE_NOW,
	 {10, 0, 10, 10, 10, 10, 10, 10}, 0, "0+1+2+3,4+5+6+7", 0xf0},
	{"eight: the most joined pairs", 8, 3, DMN_PLACE_NOW, {10, 10, 0, 10, 10, 10, 0, 10}, 0,
	 "0+1,3+4+5,7", B(3) | B(4) | B(5)},
	{"sixteen: eight, the lowest", 16, 8, DMN_PLACE_NOW,
	 {10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10}, 0, NULL, 0xff},
	{"sixteen: eight joined at the top", 16, 8, DMN_PLACE_NOW,
	 {10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10}, 0,
	 "8+9+10+11+12+13+14+15", 0xff00},
	{"more than the host has", 2, 3, DMN_PLACE_NOW, {10, 10}, 0, NULL, 0},
	{"none asked", 2, 0, DMN_PLACE_NOW, {10, 10}, 0, NULL, 0},
};

/* Preemption's choice (dmn_place_victims): victims in the order they are
 * taken, each with its leases; the indices that must be picked. */
struct vcase {
	const char *what;
	int ng;
	uint32_t mask;
	int64_t need[4], base[4];
	size_t nv;
	struct dmn_place_victim v[4];
	size_t nwant;
	size_t want[4];
};

#define ON(g, b) {1, {g}, {b}}
#define CPU {0, {0}, {0}}

static const struct vcase vcases[] = {
	{"the first victim makes room", 1, B(0), {6}, {2}, 2, {ON(0, 5), ON(0, 5)}, 1, {0}},
	{"the first too small, the second enough: the first is dropped", 1, B(0), {6}, {0}, 2,
	 {ON(0, 2), ON(0, 6)}, 1, {1}},
	{"two small ones together, no more", 1, B(0), {6}, {0}, 3, {ON(0, 3), ON(0, 3), ON(0, 3)}, 2,
	 {0, 1}},
	{"victims on GPUs outside the set are not taken", 2, B(1), {0, 6}, {0, 0}, 2,
	 {ON(0, 10), ON(1, 6)}, 1, {1}},
	{"a job on a CPU slot frees no GPU", 1, B(0), {6}, {0}, 2, {CPU, ON(0, 6)}, 1, {1}},
	{"a gang is taken whole, once, for both GPUs of the set", 2, B(0) | B(1), {4, 4}, {0, 0}, 1,
	 {{2, {0, 1}, {4, 4}}}, 1, {0}},
	{"a victim on each GPU of the set", 2, B(0) | B(1), {5, 5}, {0, 0}, 3,
	 {ON(0, 5), ON(1, 5), ON(0, 5)}, 2, {0, 1}},
	{"a GPU over its share (negative base) needs more", 1, B(0), {4}, {-2}, 2,
	 {ON(0, 4), ON(0, 2)}, 2, {0, 1}},
	{"all of them do not make room: none", 1, B(0), {10}, {0}, 2, {ON(0, 3), ON(0, 3)}, 0, {0}},
	{"nothing short: none", 1, B(0), {4}, {5}, 1, {ON(0, 4)}, 0, {0}},
};

/* links from "0+1,2+3". */
static void parse_links(const char *s, uint32_t *links)
{
	memset(links, 0, DMN_PLACE_MAX * sizeof(*links));
	while (s && *s) {
		uint32_t group = 0;
		char *end;
		do {
			long i = strtol(s, &end, 10);
			group |= B(i);
			s = end + (*end == '+');
		} while (*end == '+');
		s += *s == ',';
		for (int i = 0; i < DMN_PLACE_MAX; i++)
			if (group & B(i))
				links[i] |= group & ~B(i);
	}
}

int main(void)
{
	for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
		const struct pcase *k = &cases[c];
		struct dmn_place_gpu g[DMN_PLACE_MAX];
		for (int i = 0; i < k->ng; i++)
			g[i] = (struct dmn_place_gpu){.usable = !(k->unusable & B(i)), .need = NEED,
						      .avail = k->avail[i], .share = SHARE};
		uint32_t links[DMN_PLACE_MAX];
		parse_links(k->links, links);
		uint32_t got = dmn_place_pick(g, k->ng, k->links ? links : NULL, k->n, k->when);
		CHECK_MSG(got == k->want, "%s: got 0x%x, want 0x%x", k->what, got, k->want);
	}

	/* A need above every share never fits, even empty. */
	struct dmn_place_gpu big[2] = {{true, 11, 10, 10}, {true, 11, 10, 10}};
	CHECK_EQ_INT(dmn_place_pick(big, 2, NULL, 1, DMN_PLACE_EMPTY), 0);
	CHECK_EQ_INT(dmn_place_pick(big, DMN_PLACE_MAX + 1, NULL, 1, DMN_PLACE_NOW), 0);

	for (size_t c = 0; c < sizeof(vcases) / sizeof(vcases[0]); c++) {
		const struct vcase *k = &vcases[c];
		size_t pick[4] = {99, 99, 99, 99};
		size_t n = dmn_place_victims(k->v, k->nv, k->ng, k->mask, k->need, k->base, pick);
		CHECK_MSG(n == k->nwant, "%s: %zu victims, want %zu", k->what, n, k->nwant);
		for (size_t i = 0; i < n && n == k->nwant; i++)
			CHECK_MSG(pick[i] == k->want[i], "%s: victim %zu is %zu, want %zu", k->what, i,
				  pick[i], k->want[i]);
	}

	uint32_t links[DMN_PLACE_MAX];
	parse_links("0+1+2,3+4", links);
	CHECK_EQ_INT(dmn_place_nvlink_pairs(0x7, links, 5), 3);
	CHECK_EQ_INT(dmn_place_nvlink_pairs(0x1f, links, 5), 4);
	CHECK_EQ_INT(dmn_place_nvlink_pairs(B(0) | B(3), links, 5), 0);
	CHECK_EQ_INT(dmn_place_nvlink_pairs(0x1f, NULL, 5), 0);
	return check_status();
}
