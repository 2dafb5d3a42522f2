/* Which embedded kernel image a device loads (gpu/cuda/image_pick.c), for
 * compute capabilities from 7.5 to 12.1, over tables like the build's
 * (gpu/cuda/meson.build: sm_80, 86, 89, 90a, 100, 120 and compute_80 PTX)
 * and variants of it; then the build's own table (gpu/cuda/embed.py's
 * images.c): one sm_90a cubin, marked specific, which a 9.0 device takes
 * and no other does. Why it matters: an sm_90a cubin runs on 9.0 alone, and
 * only it holds the wgmma kernels' bodies (kernels/cuda/flash_wg.cuh), which
 * the backend launches exactly where it was loaded (image_specific).
 *
 * usage: test_images */
#include <stdio.h>
#include <string.h>

#include "gpu/cuda/images.h"
#include "tests/check.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

/* the cubin's "sm_NN[a]" for a pick (NULL: "none") */
static const char *name(const struct cu_image *im, char *buf, size_t n)
{
	if (!im)
		return "none";
	snprintf(buf, n, "%s_%d%s", im->is_ptx ? "compute" : "sm", im->arch, im->specific ? "a" : "");
	return buf;
}

static void expect_pick(const struct cu_image *tab, size_t n, int major, int minor, const char *cubin,
			const char *ptx)
{
	char a[32], b[32];
	const char *got = name(cu_image_cubin(tab, n, major, minor), a, sizeof(a));
	const char *gp = name(cu_image_ptx(tab, n, major, minor), b, sizeof(b));
	CHECK_MSG(strcmp(got, cubin) == 0, "compute capability %d.%d: cubin %s, want %s", major, minor, got,
		  cubin);
	CHECK_MSG(strcmp(gp, ptx) == 0, "compute capability %d.%d: PTX %s, want %s", major, minor, gp, ptx);
}

static const unsigned char bytes[1];
#define IMG(arch, ptx, spec) {arch, ptx, spec, bytes, sizeof(bytes)}

int main(void)
{
	/* the build's table, in embed.py's order */
	static const struct cu_image build[] = {
		IMG(80, 0, 0), IMG(86, 0, 0), IMG(89, 0, 0), IMG(90, 0, 1),
		IMG(100, 0, 0), IMG(120, 0, 0), IMG(80, 1, 0),
	};
	expect_pick(build, COUNT(build), 7, 5, "none", "none");
	expect_pick(build, COUNT(build), 8, 0, "sm_80", "compute_80");
	expect_pick(build, COUNT(build), 8, 6, "sm_86", "compute_80");
	expect_pick(build, COUNT(build), 8, 7, "sm_86", "compute_80"); /* a later minor */
	expect_pick(build, COUNT(build), 8, 9, "sm_89", "compute_80");
	expect_pick(build, COUNT(build), 9, 0, "sm_90a", "compute_80");
	/* a 9.x after 9.0 cannot run sm_90a: the PTX path */
	expect_pick(build, COUNT(build), 9, 1, "none", "compute_80");
	expect_pick(build, COUNT(build), 10, 0, "sm_100", "compute_80");
	expect_pick(build, COUNT(build), 10, 3, "sm_100", "compute_80");
	expect_pick(build, COUNT(build), 12, 0, "sm_120", "compute_80");
	expect_pick(build, COUNT(build), 12, 1, "sm_120", "compute_80");

	/* sm_90 beside sm_90a, either order: 9.0 takes the specific one, a
	 * later 9.x the portable one */
	static const struct cu_image both[] = {IMG(90, 0, 0), IMG(90, 0, 1), IMG(80, 1, 0)};
	static const struct cu_image both_r[] = {IMG(90, 0, 1), IMG(90, 0, 0), IMG(80, 1, 0)};
	expect_pick(both, COUNT(both), 9, 0, "sm_90a", "compute_80");
	expect_pick(both_r, COUNT(both_r), 9, 0, "sm_90a", "compute_80");
	expect_pick(both, COUNT(both), 9, 1, "sm_90", "compute_80");
	expect_pick(both_r, COUNT(both_r), 9, 1, "sm_90", "compute_80");
	/* the highest PTX not above the device */
	static const struct cu_image ptxs[] = {IMG(90, 1, 0), IMG(80, 1, 0), IMG(100, 1, 0)};
	expect_pick(ptxs, COUNT(ptxs), 8, 9, "none", "compute_80");
	expect_pick(ptxs, COUNT(ptxs), 9, 0, "none", "compute_90");
	expect_pick(ptxs, COUNT(ptxs), 12, 0, "none", "compute_100");

	/* this build's images.c */
	size_t specific = 0, ptx = 0;
	for (size_t i = 0; i < cu_images_count; i++) {
		CHECK(cu_images[i].data != NULL && cu_images[i].size > 0);
		specific += cu_images[i].specific != 0;
		ptx += cu_images[i].is_ptx != 0;
		if (cu_images[i].specific)
			CHECK(cu_images[i].arch == 90 && !cu_images[i].is_ptx);
	}
	CHECK(specific == 1);
	CHECK(ptx == 1);
	const struct cu_image *h = cu_image_cubin(cu_images, cu_images_count, 9, 0);
	CHECK(h != NULL && h->specific);
	const struct cu_image *a = cu_image_cubin(cu_images, cu_images_count, 8, 9);
	CHECK(a != NULL && !a->specific && a->arch == 89);
	return check_status();
}
