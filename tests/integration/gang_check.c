/* gang_check FACTOR EXPECT SAMPLE...: checks `trainctl --json ledger`
 * outputs sampled while gangs ran (tests/integration/gang.sh).
 *
 * EXPECT has a line "JOB GPUS" per job. In every sample (one consistent
 * snapshot of the ledger each): no GPU's leases sum over its share,
 * floor(total_bytes × FACTOR) of that sample's device list; every job holds
 * either none of its leases or all of them (GPUS leases, on GPUS different
 * GPUs): leases appear and go together; no lease names a job not in EXPECT.
 * Prints "N samples, G with a gang holding its GPUs, at most L leases at
 * once, jobs seen: J" and every violation; exit 1 on any. */
#include <json-c/json.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXJ 256
#define MAXG 64

static int64_t job_id[MAXJ];
static int job_gpus[MAXJ], njobs;
static int seen[MAXJ];

static int expect_index(int64_t id)
{
	for (int i = 0; i < njobs; i++)
		if (job_id[i] == id)
			return i;
	return -1;
}

static int64_t geti(json_object *o, const char *k)
{
	json_object *v;
	return json_object_object_get_ex(o, k, &v) ? json_object_get_int64(v) : 0;
}

static const char *gets(json_object *o, const char *k)
{
	json_object *v;
	return json_object_object_get_ex(o, k, &v) ? json_object_get_string(v) : "";
}

int main(int argc, char **argv)
{
	if (argc < 3) {
		fprintf(stderr, "usage: gang_check FACTOR EXPECT SAMPLE...\n");
		return 2;
	}
	double factor = strtod(argv[1], NULL);
	FILE *f = fopen(argv[2], "r");
	if (!f) {
		perror(argv[2]);
		return 2;
	}
	long long id;
	int g;
	while (njobs < MAXJ && fscanf(f, "%lld %d", &id, &g) == 2) {
		job_id[njobs] = id;
		job_gpus[njobs++] = g;
	}
	fclose(f);
	int bad = 0, gang_samples = 0, most = 0, nsamples = 0;
	for (int s = 3; s < argc; s++) {
		json_object *root = json_object_from_file(argv[s]);
		if (!root) {
			/* A sample cut short when the sampler was stopped. */
			continue;
		}
		nsamples++;
		json_object *devs = NULL, *leases = NULL;
		json_object_object_get_ex(root, "devices", &devs);
		json_object_object_get_ex(root, "leases", &leases);
		size_t nd = devs ? json_object_array_length(devs) : 0;
		size_t nl = leases ? json_object_array_length(leases) : 0;
		if ((int)nl > most)
			most = (int)nl;
		/* Per GPU: the sum against the share. */
		for (size_t d = 0; d < nd && d < MAXG; d++) {
			json_object *dev = json_object_array_get_idx(devs, d);
			const char *uuid = gets(dev, "uuid");
			uint64_t total = (uint64_t)geti(dev, "total_bytes");
			uint64_t share = (uint64_t)((long double)total * (long double)factor);
			uint64_t sum = 0;
			for (size_t k = 0; k < nl; k++) {
				json_object *l = json_object_array_get_idx(leases, k);
				if (strcmp(gets(l, "gpu"), uuid) == 0)
					sum += (uint64_t)geti(l, "bytes");
			}
			if (sum > share) {
				printf("%s: %s holds %llu bytes of leases, over its share %llu\n", argv[s],
				       uuid, (unsigned long long)sum, (unsigned long long)share);
				bad++;
			}
		}
		/* Per job: all of its leases or none, each on its own GPU. */
		int count[MAXJ] = {0};
		const char *gpu_of[MAXJ][MAXG];
		bool gang = false;
		for (size_t k = 0; k < nl; k++) {
			json_object *l = json_object_array_get_idx(leases, k);
			int64_t jid = geti(l, "job_id");
			int j = expect_index(jid);
			if (j < 0) {
				printf("%s: lease %lld names job %lld, which the test did not submit\n",
				       argv[s], (long long)geti(l, "id"), (long long)jid);
				bad++;
				continue;
			}
			const char *gpu = gets(l, "gpu");
			for (int m = 0; m < count[j] && m < MAXG; m++) {
				if (strcmp(gpu_of[j][m], gpu) == 0) {
					printf("%s: job %lld holds two leases on %s\n", argv[s],
					       (long long)jid, gpu);
					bad++;
				}
			}
			if (count[j] < MAXG)
				gpu_of[j][count[j]] = gpu;
			count[j]++;
		}
		for (int j = 0; j < njobs; j++) {
			if (!count[j])
				continue;
			seen[j] = 1;
			gang = gang || job_gpus[j] > 1;
			if (count[j] != job_gpus[j]) {
				printf("%s: job %lld holds %d of its %d leases\n", argv[s],
				       (long long)job_id[j], count[j], job_gpus[j]);
				bad++;
			}
		}
		gang_samples += gang;
		json_object_put(root);
	}
	int nseen = 0;
	for (int j = 0; j < njobs; j++)
		nseen += seen[j];
	printf("%d samples, %d with a gang holding its GPUs, at most %d leases at once, jobs seen: "
	       "%d of %d\n",
	       nsamples, gang_samples, most, nseen, njobs);
	return bad ? 1 : 0;
}
