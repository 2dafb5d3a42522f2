/* gpu_devices_query (gpu/select.h) and the daemon's device list and lease
 * sizes built on it (daemon/devices.h, dmn_sched_lease_bytes).
 *
 * The no-driver path runs on every host: $TD_CUDA_DRIVER names a library that
 * does not exist, so the module (when built) finds no driver. Then the real
 * query is checked against the kernel driver's own list,
 * /proc/driver/nvidia/gpus/<pci>/information ("GPU UUID: GPU-..."), which
 * does not go through CUDA: no such directory means no GPU, and the query must
 * report none. */
#include <dirent.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/devices.h"
#include "daemon/scheduler.h"
#include "daemon/settings.h"
#include "gpu/select.h"
#include "tests/check.h"

#define PROC_GPUS "/proc/driver/nvidia/gpus"

/* The UUIDs the kernel driver lists, into uuids[0 .. return). */
static int proc_gpus(char uuids[][64], int max)
{
	DIR *d = opendir(PROC_GPUS);
	if (!d)
		return 0;
	int n = 0;
	struct dirent *de;
	while ((de = readdir(d)) && n < max) {
		if (de->d_name[0] == '.')
			continue;
		char path[512], line[256];
		snprintf(path, sizeof(path), "%s/%s/information", PROC_GPUS, de->d_name);
		FILE *f = fopen(path, "r");
		if (!f)
			continue;
		while (fgets(line, sizeof(line), f)) {
			char u[64];
			if (sscanf(line, "GPU UUID: %63s", u) == 1) {
				snprintf(uuids[n++], 64, "%s", u);
				break;
			}
		}
		fclose(f);
	}
	closedir(d);
	return n;
}

static void test_bad_args(void)
{
	struct td_errbuf eb = {{0}};
	struct gpu_device_info info[2];
	int n = 5;
	CHECK_EQ_INT(gpu_devices_query(info, 2, NULL, &eb), TD_EINVAL);
	CHECK_EQ_INT(gpu_devices_query(NULL, 2, &n, &eb), TD_EINVAL);
	CHECK_EQ_INT(gpu_devices_query(info, -1, &n, &eb), TD_EINVAL);
	/* max 0: nothing is written, and that is not an error */
	CHECK_EQ_INT(gpu_devices_query(NULL, 0, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
}

static void test_no_driver(void)
{
	setenv("TD_CUDA_DRIVER", "/nonexistent/libcuda-for-a-test.so.1", 1);
	struct td_errbuf eb = {{0}};
	struct gpu_device_info info[4];
	int n = -1;
	CHECK_EQ_INT(gpu_devices_query(info, 4, &n, &eb), TD_OK);
	CHECK_EQ_INT(n, 0);
	CHECK_STR_EQ(eb.msg, ""); /* not an error: nothing was reported */
	char why[512];
	gpu_devices_why(why, sizeof(why));
	/* With the module: its driver is missing; without: the module is. */
	CHECK_MSG(strstr(why, "no NVIDIA driver: /nonexistent/libcuda-for-a-test.so.1") ||
			  strstr(why, "module cannot be loaded"),
		  "why: '%s'", why);
	uint64_t fr = 0, tot = 0;
	CHECK_EQ_INT(gpu_device_mem(0, &fr, &tot, &eb), TD_EUNSUPPORTED);
	CHECK_CONTAINS(eb.msg, "no CUDA device 0");

	/* The daemon's list: the simulated GPUs only, indices as listed. */
	struct dmn_devices d;
	CHECK_EQ_INT(dmn_devices_init(&d, "GPU-fake-a:4G,GPU-fake-b:1M", &eb), TD_OK);
	CHECK_EQ_INT(d.n, 2);
	CHECK_EQ_INT(d.nreal, 0);
	gpu_devices_why(why, sizeof(why));
	CHECK(why[0] != 0);
	CHECK_STR_EQ(d.why_none, why);
	CHECK_STR_EQ(d.gpu[1].uuid, "GPU-fake-b");
	CHECK_EQ_INT(d.gpu[1].index, 1);
	CHECK_EQ_INT(d.gpu[1].ordinal, -1);
	CHECK(d.gpu[0].fake);
	CHECK_EQ_INT(dmn_gpu_free_bytes(&d.gpu[0]), 4ull << 30);
	unsetenv("TD_CUDA_DRIVER");
}

/* The query as this host really is, against the kernel driver's list. */
static void test_host(void)
{
	char ref[16][64];
	int nref = proc_gpus(ref, 16);
	struct td_errbuf eb = {{0}};
	struct gpu_device_info info[16];
	int n = -1;
	CHECK_EQ_INT(gpu_devices_query(info, 16, &n, &eb), TD_OK);
	char why[512];
	gpu_devices_why(why, sizeof(why));
	printf("kernel driver lists %d GPU(s); the query found %d%s%s\n", nref, n, n ? "" : ": ",
	       why);
	if (nref == 0) {
		CHECK_EQ_INT(n, 0);
		CHECK(why[0] != 0);
		return;
	}
	/* CUDA_VISIBLE_DEVICES may hide some; never more than the driver has. */
	const char *vis = getenv("CUDA_VISIBLE_DEVICES");
	if (!vis)
		CHECK_EQ_INT(n, nref);
	CHECK(n <= nref);
	if (n > 0)
		CHECK_STR_EQ(why, "");
	for (int i = 0; i < n; i++) {
		printf("  %d: %s %s cc %d.%d, %llu bytes, %llu free\n", info[i].index, info[i].uuid,
		       info[i].name, info[i].cc_major, info[i].cc_minor,
		       (unsigned long long)info[i].total_bytes, (unsigned long long)info[i].free_bytes);
		CHECK_EQ_INT(info[i].index, i);
		bool listed = false;
		for (int k = 0; k < nref; k++)
			listed |= strcmp(ref[k], info[i].uuid) == 0;
		CHECK_MSG(listed, "%s is not in %s", info[i].uuid, PROC_GPUS);
		CHECK(info[i].name[0] != 0);
		CHECK(info[i].cc_major >= 3);
		CHECK(info[i].total_bytes > 0);
		CHECK(info[i].free_bytes <= info[i].total_bytes);
		uint64_t fr = 0, tot = 0;
		CHECK_EQ_INT(gpu_device_mem(i, &fr, &tot, &eb), TD_OK);
		CHECK_EQ_INT(tot, info[i].total_bytes);
		CHECK(fr <= tot);
	}
	struct gpu_backend *be = NULL;
	if (n > 0 && gpu_backend_open_on(&be, "cuda", n - 1, &eb) == TD_OK) {
		/* The backend's fixed allocations are what the daemon reserves. */
		CHECK_EQ_INT(be->fixed_bytes, GPU_CUDA_FIXED_BYTES);
		gpu_backend_free(be);
	}
	CHECK_EQ_INT(gpu_backend_open_on(&be, "cuda", 64, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "device ordinal 64");
}

static void test_lease_bytes(void)
{
	struct dmn_config cfg = {.cuda_context_mib = 600};
	struct dmn_gpu fake = {.fake = true, .ordinal = -1};
	struct dmn_gpu real = {.fake = false, .ordinal = 0};
	uint64_t plan = 123456789;
	CHECK_EQ_INT(dmn_sched_lease_bytes(&cfg, &fake, plan), plan);
	/* 36 MiB: 512K doubles of reduction scratch + a 32 MiB cuBLAS workspace. */
	uint64_t want = plan + (uint64_t)512 * 1024 * 8 + ((uint64_t)32 << 20) + ((uint64_t)600 << 20);
	CHECK_EQ_INT(dmn_sched_lease_bytes(&cfg, &real, plan), want);
	CHECK_EQ_INT(GPU_CUDA_FIXED_BYTES, (uint64_t)36 << 20);
	CHECK(dmn_sched_lease_bytes(&cfg, &real, UINT64_MAX - 5) == UINT64_MAX);
}

/* Links of the simulated GPUs (the fake_nvlink setting), and which jobs of
 * several GPUs a host can take. */
static void test_links(void)
{
	struct dmn_devices d;
	struct td_errbuf eb = {{0}};
	CHECK_EQ_INT(dmn_devices_init_fake(&d, "GPU-l0:1G,GPU-l1:1G,GPU-l2:1G,GPU-l3:1G", &eb), TD_OK);
	CHECK_EQ_INT(dmn_devices_links(&d, "0+1,2+3", &eb), TD_OK);
	CHECK_EQ_INT(d.nvlink[0], 0x2);
	CHECK_EQ_INT(d.nvlink[1], 0x1);
	CHECK_EQ_INT(d.nvlink[2], 0x8);
	CHECK_EQ_INT(d.nvlink[3], 0x4);
	CHECK_EQ_INT(dmn_devices_links(&d, "0+1+2,", &eb), TD_OK);
	CHECK_EQ_INT(d.nvlink[0], 0x6);
	CHECK_EQ_INT(d.nvlink[2], 0x3);
	CHECK_EQ_INT(d.nvlink[3], 0);
	CHECK_EQ_INT(dmn_devices_links(&d, "", &eb), TD_OK);
	CHECK_EQ_INT(d.nvlink[0], 0);
	static const char *const bad[] = {"0+4", "0", "1+1", "0+x", "-1+2", "0+1,3"};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		memset(&eb, 0, sizeof(eb));
		CHECK_MSG(dmn_devices_links(&d, bad[i], &eb) == TD_EINVAL, "fake_nvlink '%s'", bad[i]);
		CHECK_CONTAINS(eb.msg, "fake_nvlink: ");
	}
	char buf[64];
	CHECK_STR_EQ(dmn_devices_mask_str(0x2d, buf, sizeof(buf)), "0+2+3+5");

	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 1, &eb), TD_OK);
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 4, &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 5, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "resources.gpus: 5 GPUs asked for; this host has 4");
	/* Real GPUs take a gang only where NCCL loads (dmn_devices_init sets
	 * gang on each of several real GPUs then). */
	d.gpu[2].fake = d.gpu[3].fake = false;
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 2, &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 3, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "resources.gpus: 3: at most 2 of this host's GPUs can train one job");
	CHECK(dmn_gpu_gang_ok(&d.gpu[2], 1));
	CHECK(!dmn_gpu_gang_ok(&d.gpu[2], 2));
	CHECK(dmn_gpu_gang_ok(&d.gpu[0], 2));
	d.nreal = 2;
	snprintf(d.nccl_note, sizeof(d.nccl_note), "libnccl.so.2 cannot be loaded: test");
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 3, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "resources.gpus: 3: training on several CUDA GPUs (data parallel) needs "
			       "NCCL: libnccl.so.2 cannot be loaded: test");
	d.gpu[2].gang = d.gpu[3].gang = true;
	CHECK(dmn_gpu_gang_ok(&d.gpu[2], 2));
	CHECK_EQ_INT(dmn_devices_check_gpus(&d, 4, &eb), TD_OK);
	d.nreal = 0;
	d.gpu[2].gang = d.gpu[3].gang = false;
	struct dmn_devices none;
	CHECK_EQ_INT(dmn_devices_init_fake(&none, "", &eb), TD_OK);
	CHECK_EQ_INT(dmn_devices_check_gpus(&none, 1, &eb), TD_OK);
	memset(&eb, 0, sizeof(eb));
	CHECK_EQ_INT(dmn_devices_check_gpus(&none, 2, &eb), TD_EINVAL);
	CHECK_CONTAINS(eb.msg, "this host has none");
}

int main(void)
{
	test_bad_args();
	test_no_driver();
	test_host();
	test_lease_bytes();
	test_links();
	return check_status();
}
