// Both CUDA attention kernels (backend-cuda/kernels/attention.cu, the blocked one, and
// attention_rows.cu, decode's) run on the CPU through emu.h and compared with attention in
// double: grouped-query, causal with Tk > Tq, padding masks, head dims that are not multiples
// of 4, ragged blocks and tiles. Exits 1 on a difference over 1e-4.
#include "emu.h"

#include <cstdio>
#include <random>

#include "../../backend-cuda/kernels/attention.cu"
#include "../../backend-cuda/kernels/attention_rows.cu"

struct Case {
    unsigned hq, hkv, tq, tk, d, causal, mask;
};

static int check(const char* name, const Case& c, bool blocked) {
    std::mt19937 rng(c.tq * 131 + c.tk);
    std::normal_distribution<float> nd;
    std::vector<float> q(c.hq * c.tq * c.d), k(c.hkv * c.tk * c.d), v(c.hkv * c.tk * c.d);
    std::vector<float> m(c.tk, 1.f), o(c.hq * c.tq * c.d, -7.f);
    for (auto* x : {&q, &k, &v})
        for (auto& y : *x) y = nd(rng);
    if (c.mask)
        for (unsigned j = 1; j < c.tk; j += 3) m[j] = 0.f;
    float scale = 1.f / std::sqrt((float)c.d);
    auto run = [&] {
        auto f = blocked ? attention : attention_rows;
        f(q.data(), k.data(), v.data(), m.data(), o.data(), c.hq, c.hkv, c.tq, c.tk, c.d, c.causal,
          c.mask, scale);
    };
    if (blocked)
        launch({(c.tq + 63) / 64, c.hq, 1}, {128, 1, 1}, run);
    else
        launch({(c.tq + 3) / 4, c.hq, 1}, {128, 1, 1}, run);
    double err = 0;
    for (unsigned h = 0; h < c.hq; h++)
        for (unsigned i = 0; i < c.tq; i++) {
            unsigned kh = h / (c.hq / c.hkv);
            unsigned lim = c.causal ? std::min(c.tk, i + c.tk - c.tq + 1) : c.tk;
            std::vector<double> s;
            std::vector<unsigned> js;
            double mx = -1e300;
            for (unsigned j = 0; j < lim; j++) {
                if (c.mask && m[j] == 0) continue;
                double d = 0;
                for (unsigned e = 0; e < c.d; e++)
                    d += (double)q[(h * c.tq + i) * c.d + e] * k[(kh * c.tk + j) * c.d + e];
                s.push_back(d * scale);
                js.push_back(j);
                mx = std::max(mx, d * scale);
            }
            double l = 0;
            for (auto& x : s) l += (x = std::exp(x - mx));
            for (unsigned e = 0; e < c.d; e++) {
                double r = 0;
                for (size_t n = 0; n < s.size(); n++) r += s[n] * v[(kh * c.tk + js[n]) * c.d + e];
                r = l > 0 ? r / l : 0;
                err = std::max(err, std::fabs(r - o[(h * c.tq + i) * c.d + e]));
            }
        }
    bool ok = err < 1e-4;
    std::printf("%-15s hq %u hkv %u tq %3u tk %3u d %3u causal %u mask %u: max |diff| %.2e %s\n",
                name, c.hq, c.hkv, c.tq, c.tk, c.d, c.causal, c.mask, err, ok ? "ok" : "FAILED");
    return ok ? 0 : 1;
}

int main() {
    int failed = 0;
    for (Case c : {Case{2, 2, 70, 100, 128, 0, 0}, Case{4, 2, 65, 65, 64, 1, 0},
                   Case{2, 1, 33, 90, 40, 1, 1}, Case{2, 2, 130, 131, 128, 1, 1},
                   Case{1, 1, 40, 40, 8, 0, 0}, Case{3, 3, 1, 50, 128, 0, 1}})
        failed += check("attention", c, true);
    for (Case c : {Case{4, 2, 1, 45, 128, 1, 0}, Case{3, 1, 7, 33, 40, 1, 1},
                   Case{2, 2, 5, 70, 64, 0, 1}})
        failed += check("attention_rows", c, false);
    return failed ? 1 : 0;
}
