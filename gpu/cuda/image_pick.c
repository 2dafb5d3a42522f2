/* Which embedded kernel image a device loads (gpu/cuda/images.h): plain C
 * over the cu_images table, so that tests/unit/test_images.c checks the
 * choice for every compute capability without a GPU. */
#include "gpu/cuda/images.h"

const struct cu_image *cu_image_cubin(const struct cu_image *im, size_t n, int major, int minor)
{
	const int want = major * 10 + minor;
	const struct cu_image *best = NULL;
	for (size_t i = 0; i < n; i++) {
		const struct cu_image *c = &im[i];
		if (c->is_ptx || c->arch / 10 != major || c->arch > want)
			continue;
		if (c->specific && c->arch != want) /* sm_90a: 9.0 alone */
			continue;
		/* the highest minor; at a tie sm_90a over sm_90 (its own features) */
		if (!best || c->arch > best->arch || (c->arch == best->arch && c->specific))
			best = c;
	}
	return best;
}

const struct cu_image *cu_image_ptx(const struct cu_image *im, size_t n, int major, int minor)
{
	const int want = major * 10 + minor;
	const struct cu_image *best = NULL;
	for (size_t i = 0; i < n; i++)
		if (im[i].is_ptx && im[i].arch <= want && (!best || im[i].arch > best->arch))
			best = &im[i];
	return best;
}
