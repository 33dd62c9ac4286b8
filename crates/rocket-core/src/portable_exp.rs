//! e^x and ln x for the sampler, with the same bits on every platform and on the GPU.
//!
//! `f64::exp` calls the platform's libm, whose last bit differs between
//! libraries and from CUDA's `exp`. A sampled token must not depend on that, so
//! the sampler uses this function and `kernels/src/sample.cu` has a twin that
//! performs the same IEEE operations in the same order (each multiply, add and
//! fused multiply-add is correctly rounded on both sides). Accuracy: within
//! 2 ulp of the true value on the range the sampler uses, [-44, 0].

/// ln 2 split so that k·LN2_HI is exact for |k| < 2^11 (Cody–Waite).
const LN2_HI: f64 = f64::from_bits(0x3fe6_2e42_fee0_0000);
const LN2_LO: f64 = f64::from_bits(0x3dea_39ef_3579_3c76);
const LOG2_E: f64 = f64::from_bits(0x3ff7_1547_652b_82fe);

/// 1/n! for n = 13 down to 2 (Taylor series of e^r around 0; |r| ≤ ln2/2 makes
/// the first dropped term, r^14/14!, below 2^-60).
const INV_FACTORIALS: [f64; 12] = [
    f64::from_bits(0x3de6_1246_13a8_6d09),
    f64::from_bits(0x3e21_eed8_eff8_d898),
    f64::from_bits(0x3e5a_e645_67f5_44e4),
    f64::from_bits(0x3e92_7e4f_b778_9f5c),
    f64::from_bits(0x3ec7_1de3_a556_c734),
    f64::from_bits(0x3efa_01a0_1a01_a01a),
    f64::from_bits(0x3f2a_01a0_1a01_a01a),
    f64::from_bits(0x3f56_c16c_16c1_6c17),
    f64::from_bits(0x3f81_1111_1111_1111),
    f64::from_bits(0x3fa5_5555_5555_5555),
    f64::from_bits(0x3fc5_5555_5555_5555),
    f64::from_bits(0x3fe0_0000_0000_0000),
];

/// e^x for x in [-700, 700]; NaN stays NaN. Outside that range the result
/// saturates to 0 or +inf (the sampler never goes there).
pub fn portable_exp(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let x = x.clamp(-700.0, 700.0);
    let k = (x * LOG2_E).round_ties_even();
    let r = (-k).mul_add(LN2_LO, (-k).mul_add(LN2_HI, x));
    let mut p = INV_FACTORIALS[0];
    for &c in &INV_FACTORIALS[1..] {
        p = p.mul_add(r, c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    // 2^k is a normal number for |k| ≤ 1010, so the scaling is exact.
    p * f64::from_bits(((1023 + k as i64) as u64) << 52)
}

/// Σ e^(v − max) over `values`, in f64: what a log-softmax's normaliser needs
/// (`sampling::logprobs`). Each term is `portable_exp`'s, but 0 below e^-700
/// (and for -inf); a NaN anywhere makes the sum NaN. Eight interleaved partial
/// sums, added in order at the end, keep the loop free of a serial dependency so
/// it runs on the vector units: ~3x faster than libm's `exp` one term at a time
/// over a 151,936-token vocabulary, with the same bits on every host with fused
/// multiply-add (x86-64 with AVX2 and FMA, Arm). An x86-64 CPU without them takes
/// libm's `exp` per term (emulating the fused operations would cost ~20x more),
/// in the same order: a sum within a few ulp of the others'.
pub fn sum_exp_below(values: &[f32], max: f64) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            // SAFETY: the CPU has the features the clone is compiled for.
            return unsafe { sum_exp_below_avx2(values, max) };
        }
        sum_in_lanes(values, max, libm_term)
    }
    #[cfg(not(target_arch = "x86_64"))]
    sum_in_lanes(values, max, exp_at_most_zero)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_exp_below_avx2(values: &[f32], max: f64) -> f64 {
    sum_in_lanes(values, max, exp_at_most_zero)
}

/// The term of a host without fused multiply-add: libm's e^x, 0 below -700.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn libm_term(x: f64) -> f64 {
    if x < -700.0 { 0.0 } else { x.exp() }
}

/// Σ term(v − max) in eight partial sums (element i into sum i mod 8), added in order.
#[inline(always)]
fn sum_in_lanes(values: &[f32], max: f64, term: impl Fn(f64) -> f64) -> f64 {
    // Blocks through a stack buffer: a plain map over it is what the loop
    // vectoriser recognises, and the lanes' sums stay in a fixed order.
    const LANES: usize = 8;
    const BLOCK: usize = 512;
    let mut acc = [0.0f64; LANES];
    let mut terms = [0.0f64; BLOCK];
    for block in values.chunks(BLOCK) {
        let terms = &mut terms[..block.len()];
        for (t, &v) in terms.iter_mut().zip(block) {
            *t = term(v as f64 - max);
        }
        let lanes = terms.chunks_exact(LANES);
        let tail = lanes.remainder();
        for c in lanes {
            for j in 0..LANES {
                acc[j] += c[j];
            }
        }
        for (j, &t) in tail.iter().enumerate() {
            acc[j] += t;
        }
    }
    acc.iter().sum()
}

/// `portable_exp(x)` for x ≤ 0, written without branches or calls so that a
/// loop of it vectorises: k by the 1.5·2^52 shifter (round to nearest even, as
/// `round_ties_even`), 2^k from the shifted value's bits; below -700 (and -inf) 0.
#[inline(always)]
fn exp_at_most_zero(x: f64) -> f64 {
    const SHIFTER: f64 = 6_755_399_441_055_744.0; // 1.5 · 2^52
    let xc = if x < -700.0 { -700.0 } else { x }; // NaN stays NaN
    let t = xc * LOG2_E + SHIFTER;
    let k = t - SHIFTER;
    let r = (-k).mul_add(LN2_LO, (-k).mul_add(LN2_HI, xc));
    let mut p = INV_FACTORIALS[0];
    for &c in &INV_FACTORIALS[1..] {
        p = p.mul_add(r, c);
    }
    p = p.mul_add(r, 1.0);
    p = p.mul_add(r, 1.0);
    let k_int = t.to_bits().wrapping_sub(SHIFTER.to_bits());
    let scale = f64::from_bits(k_int.wrapping_add(1023) << 52);
    if x < -700.0 { 0.0 } else { p * scale }
}

/// 2/(2k+1) for k = 11 down to 1: 2·atanh(s) = 2s + s·s²·Σ 2/(2k+1)·s^(2k-2).
/// With |s| ≤ 0.172 (s² ≤ 0.0295) the first dropped term is below 2^-60.
const ATANH_COEFFS: [f64; 11] = [
    f64::from_bits(0x3fb6_42c8_590b_2164),
    f64::from_bits(0x3fb8_6186_1861_8618),
    f64::from_bits(0x3fba_f286_bca1_af28),
    f64::from_bits(0x3fbe_1e1e_1e1e_1e1e),
    f64::from_bits(0x3fc1_1111_1111_1111),
    f64::from_bits(0x3fc3_b13b_13b1_3b14),
    f64::from_bits(0x3fc7_45d1_745d_1746),
    f64::from_bits(0x3fcc_71c7_1c71_c71c),
    f64::from_bits(0x3fd2_4924_9249_2492),
    f64::from_bits(0x3fd9_9999_9999_999a),
    f64::from_bits(0x3fe5_5555_5555_5555),
];
const SQRT_2: f64 = f64::from_bits(0x3ff6_a09e_667f_3bcd);

/// ln x for a finite x > 0 (the sampler's Gumbel noise); 0 and below give -inf
/// and NaN, +inf gives +inf. Written as the device does it (`sampler.cuh`
/// `portable_ln`): x = 2^e·m with m in [√½, √2), ln m = 2·atanh((m-1)/(m+1)).
pub fn portable_ln(x: f64) -> f64 {
    if x.is_nan() || x < 0.0 {
        return f64::NAN;
    }
    if x == 0.0 {
        return f64::NEG_INFINITY;
    }
    if x.is_infinite() {
        return x;
    }
    let (mut bits, mut e) = (x.to_bits(), 0i64);
    if bits >> 52 == 0 {
        // Subnormal: scale into the normal range (exact).
        bits = (x * f64::from_bits(0x4350_0000_0000_0000)).to_bits(); // 2^54
        e = -54;
    }
    e += ((bits >> 52) & 0x7ff) as i64 - 1023;
    let mut m = f64::from_bits((bits & 0x000f_ffff_ffff_ffff) | 0x3ff0_0000_0000_0000);
    if m > SQRT_2 {
        m *= 0.5;
        e += 1;
    }
    let s = (m - 1.0) / (m + 1.0);
    let s2 = s * s;
    let mut q = ATANH_COEFFS[0];
    for &c in &ATANH_COEFFS[1..] {
        q = q.mul_add(s2, c);
    }
    let ln_m = (s * s2).mul_add(q, 2.0 * s);
    let e = e as f64;
    e.mul_add(LN2_HI, e.mul_add(LN2_LO, ln_m))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ulps(a: f64, b: f64) -> u64 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs()
    }

    #[test]
    fn within_two_ulp_of_libm_over_the_sampler_range() {
        let mut worst = 0;
        let mut s = 0x1234_5678_9abc_def0_u64;
        for i in 0..200_000 {
            // A grid plus pseudo-random points in [-44, 0].
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            let x = if i % 2 == 0 { -44.0 * i as f64 / 200_000.0 } else { -44.0 * (s >> 11) as f64 / (1u64 << 53) as f64 };
            worst = worst.max(ulps(portable_exp(x), x.exp()));
        }
        assert!(worst <= 2, "worst error {worst} ulp");
    }

    #[test]
    fn exact_points_and_edges() {
        assert_eq!(portable_exp(0.0), 1.0);
        assert_eq!(portable_exp(-0.0), 1.0);
        assert!(portable_exp(f64::NAN).is_nan());
        assert!(ulps(portable_exp(1.0), std::f64::consts::E) <= 1);
        assert!(ulps(portable_exp(-700.0), (-700.0f64).exp()) <= 2);
        assert!(ulps(portable_exp(700.0), 700.0f64.exp()) <= 2);
        assert_eq!(portable_exp(-1e300), portable_exp(-700.0));
    }

    #[test]
    fn sum_exp_below_is_portable_exps_terms_in_lanes() {
        // Fresh logits over a wide range, a tail that is not a multiple of the lanes.
        let mut s = 0x9e37_79b9_7f4a_7c15_u64;
        let values: Vec<f32> = (0..100_003)
            .map(|_| {
                s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / 16_777_216.0) * 60.0 - 45.0
            })
            .collect();
        let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        // The same terms summed in the same lane order, one portable_exp at a time.
        let mut lanes = [0.0f64; 8];
        for (i, &v) in values.iter().enumerate() {
            let i = if i >= values.len() / 8 * 8 { i - values.len() / 8 * 8 } else { i % 8 };
            lanes[i] += portable_exp(v as f64 - max);
        }
        let want: f64 = lanes.iter().sum();
        assert_eq!(sum_in_lanes(&values, max, exp_at_most_zero).to_bits(), want.to_bits());
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            assert_eq!(sum_exp_below(&values, max).to_bits(), want.to_bits());
        }
        // A host without FMA sums libm's terms in the same lanes: within rounding.
        let fallback = sum_in_lanes(&values, max, libm_term);
        assert!(((fallback - want) / want).abs() < 1e-14, "{fallback} against {want}");
        // And libm's serial sum agrees to rounding.
        let libm: f64 = values.iter().map(|&v| (v as f64 - max).exp()).sum();
        assert!(((sum_exp_below(&values, max) - libm) / libm).abs() < 1e-13);
    }

    #[test]
    fn sum_exp_below_edges() {
        assert_eq!(sum_exp_below(&[], 0.0), 0.0);
        assert_eq!(sum_exp_below(&[0.0], 0.0), 1.0);
        // -inf and terms far below the maximum add nothing; exp(-700) is not 0 but is left out.
        assert_eq!(sum_exp_below(&[f32::NEG_INFINITY, 0.0, -800.0, f32::NEG_INFINITY], 0.0), 1.0);
        assert_eq!(sum_in_lanes(&[-700.0], 0.0, exp_at_most_zero), portable_exp(-700.0));
        assert!(sum_exp_below(&[0.0, f32::NAN, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0], 7.0).is_nan());
        // 2^k over the whole range of k the terms take.
        for k in -1009..=0 {
            let x = k as f64 * std::f64::consts::LN_2;
            assert_eq!(exp_at_most_zero(x).to_bits(), portable_exp(x).to_bits(), "x = {x}");
        }
    }

    #[test]
    fn ln_within_two_ulp_of_libm_and_exact_at_powers_of_two() {
        let mut worst = 0;
        let mut s = 0x0ddc_0ffe_e15_u64;
        for _ in 0..200_000 {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            // Over (0, 40]: what the Gumbel noise takes (uniforms in (0, 1), then -ln of them).
            let x = 40.0 * ((s >> 11) as f64 + 0.5) / (1u64 << 53) as f64;
            worst = worst.max(ulps(portable_ln(x), x.ln()));
        }
        assert!(worst <= 2, "worst error {worst} ulp");
        assert_eq!(portable_ln(1.0), 0.0);
        assert_eq!(portable_ln(0.5), -std::f64::consts::LN_2);
        assert!(ulps(portable_ln(1.0 - f64::EPSILON / 2.0), -f64::EPSILON / 2.0) <= 1);
        assert!(ulps(portable_ln(f64::MIN_POSITIVE / 4.0), (f64::MIN_POSITIVE / 4.0).ln()) <= 2);
        assert_eq!(portable_ln(0.0), f64::NEG_INFINITY);
        assert!(portable_ln(-1.0).is_nan());
    }
}
