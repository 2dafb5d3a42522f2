/* bench_attn's sanity check (tests/bench/attn_check.h) on a machine without
 * a GPU: it must pass the fused attention's arithmetic and fail wrong
 * results, or the benchmark's "check": "ok" would mean nothing.
 *
 * emulate() plays kernels/cuda/flash.cu's float arithmetic on the CPU in
 * the kernels' order of operations (key tiles of 64 with the online softmax
 * and its rescales; the forward's powers 2^(s log2(e)/sqrt(HS) - m) with
 * one fma for the exponent and results under 2^-126 flushed to 0, the
 * backward's 2^(s log2(e)/sqrt(HS) - L) likewise; P and dS
 * rounded to bf16 before their products, dout's bf16 copy, D from out16
 * widened, fp32 out normalised then rounded to bf16 (out16), per-head dK and
 * dV partials added in head order), with IEEE sums in place of the tensor
 * cores' (which the check's bounds allow twice the rounding). Cases: GQA and
 * not, T crossing the tiles, head sizes 64 and 128. Then each of a table of
 * faults (a mask one key too far, the wrong kv head for a query head, dk
 * without its scale, a head's dV partial dropped, L off by 2^-6, one dq
 * row's values swapped) must make the check fail where it should, naming
 * the direction. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tests/bench/attn_check.h"
#include "tests/check.h"

#define COUNT(a) (sizeof(a) / sizeof((a)[0]))

enum fault { F_NONE, F_MASK, F_KVHEAD, F_DK_SCALE, F_DV_HEAD, F_L, F_DQ_SWAP };
static const char *fault_name[] = {"none", "mask one key too far", "wrong kv head",
				   "dk without its scale", "a head's dV partial dropped",
				   "L off by 2^-6", "a dq row's values swapped"};

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double uniform01(void)
{
	rng ^= rng << 13;
	rng ^= rng >> 7;
	rng ^= rng << 17;
	return ((double)(rng >> 11) + 0.5) / 9007199254740992.0;
}
static float normal(void)
{
	return (float)(sqrt(-2.0 * log(uniform01())) * cos(2.0 * M_PI * uniform01()));
}

/* float to bf16, round to nearest even (finite values), as __float2bfloat16_rn */
static uint16_t bf16(float f)
{
	uint32_t x;
	memcpy(&x, &f, sizeof(x));
	x += 0x7fffu + ((x >> 16) & 1u);
	return (uint16_t)(x >> 16);
}
static float r16(float f)
{
	return attn_widen(bf16(f));
}

struct buf {
	uint16_t *q, *k, *v, *o;
	float *dout, *lse, *dr, *dq, *dk, *dv, *pk, *pv;
};

static void *xcalloc(size_t n, size_t size)
{
	void *p = calloc(n ? n : 1, size);
	if (!p) {
		fprintf(stderr, "test_attn_check: out of memory\n");
		exit(1);
	}
	return p;
}

static void emulate(const struct attn_shape *s, struct buf *m, enum fault fault)
{
	const int B = s->B, T = s->T, NH = s->NH, NKV = s->NKV, HS = s->HS, rep = NH / NKV;
	const float sl2 = 1.4426950408889634f * (1.0f / sqrtf((float)HS));
	const float scale = 1.0f / sqrtf((float)HS);
	const int ldq = NH * HS, ldk = NKV * HS;
	float *x = xcalloc((size_t)T, sizeof(float)), *o = xcalloc((size_t)HS, sizeof(float));
	float *acc = xcalloc((size_t)HS, sizeof(float));
#define Q(b, t, h) (m->q + ((size_t)(b) * T + (t)) * ldq + (size_t)(h) * HS)
#define K(b, t, g) (m->k + ((size_t)(b) * T + (t)) * ldk + (size_t)(g) * HS)
#define V(b, t, g) (m->v + ((size_t)(b) * T + (t)) * ldk + (size_t)(g) * HS)
#define OFF(b, t, h) (((size_t)(b) * T + (t)) * ldq + (size_t)(h) * HS)
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			const int g = fault == F_KVHEAD ? h % NKV : h / rep;
			for (int t = 0; t < T; t++) {
				const int last = fault == F_MASK && t + 1 < T ? t + 1 : t;
				float mx = -INFINITY, l = 0;
				memset(o, 0, (size_t)HS * sizeof(float));
				for (int k0 = 0; k0 <= last; k0 += 64) {
					const int k1 = k0 + 64 <= last + 1 ? k0 + 64 : last + 1;
					float tm = mx;
					for (int j = k0; j < k1; j++) {
						float sc = 0;
						for (int c = 0; c < HS; c++)
							sc += attn_widen(Q(b, t, h)[c]) * attn_widen(K(b, j, g)[c]);
						x[j] = sc; /* raw: scaled in the fma below */
						tm = fmaxf(tm, sc * sl2);
					}
					const float cr = exp2f(mx - tm);
					mx = tm;
					float rs = 0;
					for (int c = 0; c < HS; c++)
						o[c] *= cr;
					for (int j = k0; j < k1; j++) {
						float p = exp2f(fmaf(x[j], sl2, -mx));
						if (p < 0x1p-126f)
							p = 0; /* ex2.approx.ftz */
						rs += p;
						const float p16 = r16(p);
						for (int c = 0; c < HS; c++)
							o[c] += p16 * attn_widen(V(b, j, g)[c]);
					}
					l = l * cr + rs;
				}
				const float il = 1.0f / l;
				for (int c = 0; c < HS; c++)
					m->o[OFF(b, t, h) + c] = bf16(o[c] * il);
				m->lse[((size_t)b * NH + h) * T + t] =
					mx + log2f(l) + (fault == F_L ? 0x1p-6f : 0.0f);
			}
		}
	/* backward */
	for (int b = 0; b < B; b++)
		for (int h = 0; h < NH; h++) {
			const int g = fault == F_KVHEAD ? h % NKV : h / rep;
			for (int t = 0; t < T; t++) {
				float d = 0;
				for (int c = 0; c < HS; c++)
					d += m->dout[OFF(b, t, h) + c] * attn_widen(m->o[OFF(b, t, h) + c]);
				m->dr[((size_t)b * NH + h) * T + t] = d;
			}
			for (int t = 0; t < T; t++) {
				const float L = m->lse[((size_t)b * NH + h) * T + t];
				const float D = m->dr[((size_t)b * NH + h) * T + t];
				const int last = fault == F_MASK && t + 1 < T ? t + 1 : t;
				memset(acc, 0, (size_t)HS * sizeof(float));
				for (int j = 0; j <= last; j++) {
					float sc = 0, dP = 0;
					for (int c = 0; c < HS; c++) {
						sc += attn_widen(Q(b, t, h)[c]) * attn_widen(K(b, j, g)[c]);
						dP += r16(m->dout[OFF(b, t, h) + c]) * attn_widen(V(b, j, g)[c]);
					}
					float P = exp2f(fmaf(sc, sl2, -L));
					if (P < 0x1p-126f)
						P = 0; /* ex2.approx.ftz */
					const float dS = r16(P * (dP - D));
					const float P16 = r16(P);
					for (int c = 0; c < HS; c++) {
						acc[c] += dS * attn_widen(K(b, j, g)[c]);
						/* the per-head partials, keys j, over the queries t */
						m->pk[OFF(b, j, h) + c] += dS * attn_widen(Q(b, t, h)[c]);
						m->pv[OFF(b, j, h) + c] += P16 * r16(m->dout[OFF(b, t, h) + c]);
					}
				}
				for (int c = 0; c < HS; c++)
					m->dq[OFF(b, t, h) + c] = acc[c] * scale;
			}
		}
	if (fault == F_DQ_SWAP) { /* row T - 1 of head 0, batch 0: two values swapped */
		float *r = m->dq + OFF(0, T - 1, 0);
		const float a = r[0];
		r[0] = r[1];
		r[1] = a;
	}
	for (int b = 0; b < B; b++)
		for (int j = 0; j < T; j++)
			for (int g = 0; g < NKV; g++)
				for (int c = 0; c < HS; c++) {
					float sk = 0, sv = 0;
					for (int r = 0; r < rep; r++) {
						const size_t at = OFF(b, j, g * rep + r) + c;
						sk += m->pk[at] * (fault == F_DK_SCALE ? 1.0f : scale);
						if (!(fault == F_DV_HEAD && r == rep - 1))
							sv += m->pv[at];
					}
					const size_t at = (((size_t)b * T + j) * NKV + g) * HS + c;
					m->dk[at] = sk;
					m->dv[at] = sv;
				}
#undef Q
#undef K
#undef V
#undef OFF
	free(x), free(o), free(acc);
}

int main(void)
{
	static const struct attn_shape cases[] = {
		{2, 200, 4, 2, 64}, {1, 130, 2, 2, 128}, {1, 384, 8, 2, 128}, {1, 1, 2, 1, 64},
	};
	for (size_t ci = 0; ci < COUNT(cases); ci++) {
		const struct attn_shape *s = &cases[ci];
		const size_t nq = (size_t)s->B * s->T * s->NH * s->HS;
		const size_t nk = (size_t)s->B * s->T * s->NKV * s->HS, nl = (size_t)s->B * s->NH * s->T;
		uint16_t *q = xcalloc(nq, 2), *k = xcalloc(nk, 2), *v = xcalloc(nk, 2);
		float *dout = xcalloc(nq, sizeof(float));
		for (size_t i = 0; i < nq; i++)
			q[i] = bf16(normal()), dout[i] = normal();
		for (size_t i = 0; i < nk; i++)
			k[i] = bf16(normal()), v[i] = bf16(normal());
		for (int f = F_NONE; f <= F_DQ_SWAP; f++) {
			if (f == F_KVHEAD && (s->NKV == 1 || s->NH == s->NKV))
				continue; /* h % NKV is h / rep: no other kv head to take */
			if (f == F_DV_HEAD && s->NH == s->NKV)
				continue; /* no group's partials to add */
			if ((f == F_MASK || f == F_DK_SCALE || f == F_DQ_SWAP) && s->T == 1)
				continue; /* one key: dq and dk are 0 (up to rounding) */
			struct buf m = {.q = q, .k = k, .v = v, .dout = dout};
			m.o = xcalloc(nq, 2);
			m.lse = xcalloc(nl, sizeof(float));
			m.dr = xcalloc(nl, sizeof(float));
			m.dq = xcalloc(nq, sizeof(float));
			m.pk = xcalloc(nq, sizeof(float));
			m.pv = xcalloc(nq, sizeof(float));
			m.dk = xcalloc(nk, sizeof(float));
			m.dv = xcalloc(nk, sizeof(float));
			emulate(s, &m, (enum fault)f);
			struct attn_host ah = {.s = *s, .q = q, .k = k, .v = v, .o = m.o, .dout = dout,
					       .lse = m.lse, .dr = m.dr, .dq = m.dq, .dk = m.dk,
					       .dv = m.dv};
			struct attn_check cf, cb;
			CHECK(attn_check(&ah, &cf, &cb));
			fprintf(stderr,
				"B=%d T=%d NH=%d NKV=%d HS=%d, %s: forward %zu of %zu over, worst "
				"%.3g at %s; backward %zu of %zu over, worst %.3g at %s\n",
				s->B, s->T, s->NH, s->NKV, s->HS, fault_name[f], cf.bad, cf.n, cf.worst,
				cf.what, cb.bad, cb.n, cb.worst, cb.what);
			CHECK(cf.n > 0 && cb.n > 0);
			switch (f) {
			case F_NONE:
				CHECK_MSG(cf.bad == 0 && cb.bad == 0,
					  "the kernels' arithmetic fails the check (T=%d HS=%d)", s->T,
					  s->HS);
				break;
			case F_MASK:
			case F_KVHEAD:
			case F_L:
				CHECK_MSG(cf.bad > 0, "%s passes the forward's check (T=%d HS=%d)",
					  fault_name[f], s->T, s->HS);
				break;
			default:
				CHECK_MSG(cf.bad == 0, "%s fails the forward's check (T=%d HS=%d)",
					  fault_name[f], s->T, s->HS);
				CHECK_MSG(cb.bad > 0, "%s passes the backward's check (T=%d HS=%d)",
					  fault_name[f], s->T, s->HS);
				break;
			}
			free(m.o), free(m.lse), free(m.dr), free(m.dq), free(m.pk), free(m.pv);
			free(m.dk), free(m.dv);
		}
		free(q), free(k), free(v), free(dout);
	}
	return check_status();
}
