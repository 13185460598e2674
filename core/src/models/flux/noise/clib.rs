//! glibc's `logf`, `sinf` and `cosf` (2.28 on, `sysdeps/ieee754/flt-32`, from ARM's optimized
//! routines): what torch's scalar noise kernel calls on Linux, transcribed in plain f64. Each
//! computes in double and rounds once; glibc's FMA and SSE2 builds agree on all 2^24 inputs
//! torch can pass, and so does this, with no C library (and so no CPU dispatch) involved.

const fn d(bits: u64) -> f64 {
    f64::from_bits(bits)
}

/// `__logf_data.tab`: (1/c, log c) for the 16 subintervals.
const LOGF_TAB: [(f64, f64); 16] = [
    (d(0x3ff661ec79f8f3be), d(0xbfd57bf7808caade)),
    (d(0x3ff571ed4aaf883d), d(0xbfd2bef0a7c06ddb)),
    (d(0x3ff49539f0f010b0), d(0xbfd01eae7f513a67)),
    (d(0x3ff3c995b0b80385), d(0xbfcb31d8a68224e9)),
    (d(0x3ff30d190c8864a5), d(0xbfc6574f0ac07758)),
    (d(0x3ff25e227b0b8ea0), d(0xbfc1aa2bc79c8100)),
    (d(0x3ff1bb4a4a1a343f), d(0xbfba4e76ce8c0e5e)),
    (d(0x3ff12358f08ae5ba), d(0xbfb1973c5a611ccc)),
    (d(0x3ff0953f419900a7), d(0xbfa252f438e10c1e)),
    (d(0x3ff0000000000000), d(0x0000000000000000)),
    (d(0x3fee608cfd9a47ac), d(0x3faaa5aa5df25984)),
    (d(0x3feca4b31f026aa0), d(0x3fbc5e53aa362eb4)),
    (d(0x3feb2036576afce6), d(0x3fc526e57720db08)),
    (d(0x3fe9c2d163a1aa2d), d(0x3fcbc2860d224770)),
    (d(0x3fe886e6037841ed), d(0x3fd1058bc8a07ee1)),
    (d(0x3fe767dcf5534862), d(0x3fd4043057b6ee09)),
];
const LN2: f64 = d(0x3fe62e42fefa39ef);
const LOGF_A: [f64; 3] = [
    d(0xbfd00ea348b88334),
    d(0x3fd5575b0be00b6a),
    d(0xbfdffffef20a4123),
];

/// glibc's `logf`.
pub fn logf(x: f32) -> f32 {
    let mut ix = x.to_bits();
    if ix == 0x3f80_0000 {
        return 0.0;
    }
    if ix.wrapping_sub(0x0080_0000) >= 0x7f80_0000 - 0x0080_0000 {
        if ix << 1 == 0 {
            return f32::NEG_INFINITY;
        }
        if ix == 0x7f80_0000 {
            return x;
        }
        if ix & 0x8000_0000 != 0 || ix << 1 >= 0xff00_0000 {
            return f32::NAN;
        }
        // A subnormal: normalized.
        ix = (x * 8_388_608.0).to_bits().wrapping_sub(23 << 23);
    }
    let tmp = ix.wrapping_sub(0x3f33_0000);
    let i = ((tmp >> 19) % 16) as usize;
    let k = (tmp as i32) >> 23;
    let iz = ix.wrapping_sub(tmp & 0xff80_0000);
    let (invc, logc) = LOGF_TAB[i];
    let z = f32::from_bits(iz) as f64;
    let r = z * invc - 1.0;
    let y0 = logc + k as f64 * LN2;
    let r2 = r * r;
    let y = LOGF_A[1] * r + LOGF_A[2];
    let y = LOGF_A[0] * r2 + y;
    (y * r2 + (y0 + r)) as f32
}

/// 2/pi * 2^24.
const HPI_INV: f64 = d(0x41645f306dc9c883);
const HPI: f64 = d(0x3ff921fb54442d18);
/// `__sincosf_table[0]`'s cosine polynomial (entry 1 is the same negated).
const COS: [f64; 5] = [
    1.0,
    d(0xbfdffffffd0c621c),
    d(0x3fa55553e1068f19),
    d(0xbf56c087e89a359d),
    d(0x3ef99343027bf8c3),
];
const SIN: [f64; 3] = [
    d(0xbfc555545995a603),
    d(0x3f81107605230bc4),
    d(0xbf2994eb3774cf24),
];
const SIGN: [f64; 4] = [1.0, -1.0, -1.0, 1.0];
/// 2 pi * 2^-64.
const PI63: f64 = d(0x3c1921fb54442d18);
/// `__inv_pio4`: 4/pi to 192 bits.
const INV_PIO4: [u32; 24] = [
    0xa2, 0xa2f9, 0xa2f983, 0xa2f9836e, 0xf9836e4e, 0x836e4e44, 0x6e4e4415, 0x4e441529, 0x441529fc,
    0x1529fc27, 0x29fc2757, 0xfc2757d1, 0x2757d1f5, 0x57d1f534, 0xd1f534dd, 0xf534ddc0, 0x34ddc0db,
    0xddc0db62, 0xc0db6295, 0xdb629599, 0x6295993c, 0x95993c43, 0x993c4390, 0x3c439041,
];

fn abstop12(x: f32) -> u32 {
    (x.to_bits() >> 20) & 0x7ff
}

/// `sinf_poly`: the sine polynomial for even `n`, the cosine one for odd (negated for table 1).
fn poly(x: f64, x2: f64, n: i32, table1: bool) -> f32 {
    if n & 1 == 0 {
        let x3 = x * x2;
        let s1 = SIN[1] + x2 * SIN[2];
        let x7 = x3 * x2;
        let s = x + x3 * SIN[0];
        (s + x7 * s1) as f32
    } else {
        let k = if table1 { COS.map(|v| -v) } else { COS };
        let x4 = x2 * x2;
        let c2 = k[3] + x2 * k[4];
        let c1 = k[0] + x2 * k[1];
        let x6 = x4 * x2;
        let c = c1 + x4 * k[2];
        (c + x6 * c2) as f32
    }
}

fn reduce_fast(x: f64) -> (f64, i32) {
    let r = x * HPI_INV;
    let n = (r as i32).wrapping_add(0x80_0000) >> 24;
    (x - n as f64 * HPI, n)
}

fn reduce_large(xi: u32) -> (f64, i32) {
    let arr = &INV_PIO4[((xi >> 26) & 15) as usize..];
    let x = ((xi & 0xff_ffff) | 0x80_0000) << ((xi >> 23) & 7);
    let res0 = x.wrapping_mul(arr[0]) as u64;
    let res1 = x as u64 * arr[4] as u64;
    let res2 = x as u64 * arr[8] as u64;
    let res0 = ((res2 >> 32) | (res0 << 32)).wrapping_add(res1);
    let n = res0.wrapping_add(1 << 61) >> 62;
    let res0 = res0.wrapping_sub(n << 62);
    (res0 as i64 as f64 * PI63, n as i32)
}

fn sin_cos(y: f32, cos: bool) -> f32 {
    let (x, top, odd) = (y as f64, abstop12(y), cos as i32);
    if top < 0x3f4 {
        // |y| < pi/4.
        if top < 0x398 {
            // |y| < 2^-12.
            return if cos { 1.0 } else { y };
        }
        return poly(x, x * x, odd, false);
    }
    let (x, n, q) = if top < 0x42f {
        // |y| < 120.
        let (x, n) = reduce_fast(x);
        (x, n, n)
    } else if top < 0x7f8 {
        let (x, n) = reduce_large(y.to_bits());
        (x, n, n.wrapping_add((y.to_bits() >> 31) as i32))
    } else {
        return f32::NAN;
    };
    poly(x * SIGN[(q & 3) as usize], x * x, n ^ odd, q & 2 != 0)
}

/// glibc's `sinf`.
pub fn sinf(y: f32) -> f32 {
    sin_cos(y, false)
}

/// glibc's `cosf`.
pub fn cosf(y: f32) -> f32 {
    sin_cos(y, true)
}
