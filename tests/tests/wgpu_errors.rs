//! wgpu device errors are values: an arena over the adapter's `max_buffer_size` is refused naming
//! what was asked, a buffer the device rejects (a validation error inside an error scope) is this
//! call's error and not a panic, and the backend keeps working after either; ops are submitted
//! in batches, not one submit per op.

use nibble_core::backend::{run_op, Backend};
use nibble_core::graph::{HostTensor, OpKind};
use nibble_tests::build::random_values;
use nibble_tests::wgpu_or_absent;

#[test]
fn an_arena_over_max_buffer_size_is_an_error_naming_it() {
    let Some(mut b) = wgpu_or_absent("wgpu errors") else {
        return;
    };
    let max = b.limits().max_buffer_size;
    let words = usize::try_from(max / 4 + 1024).expect("fits usize");
    let e = b
        .allocate(words, 1 << 20, 0)
        .expect_err("over the limit")
        .to_string();
    assert!(
        e.contains("activation arena")
            && e.contains("max_buffer_size")
            && e.contains(&max.to_string()),
        "{e}"
    );
    let e = b
        .allocate(1024, max + 4096, 0)
        .expect_err("pool over the limit")
        .to_string();
    assert!(
        e.contains("weight pool") && e.contains("max_buffer_size"),
        "{e}"
    );
    // Still usable: one op through the regular path.
    let x = HostTensor::f32(&[3, 5], random_values(15, 1)).expect("x");
    let y = run_op(&mut b, &OpKind::Silu, &[&x], None).expect("silu after the refusals");
    assert_eq!(y.info.shape, vec![3, 5]);
}

#[test]
fn a_buffer_the_device_rejects_is_an_error_not_a_panic() {
    let Some(b) = wgpu_or_absent("wgpu errors") else {
        return;
    };
    // MAP_READ may only go with COPY_DST without the MAPPABLE_PRIMARY_BUFFERS feature: a
    // validation error, captured by the error scope around the creation.
    let usage =
        nibble_wgpu::wgpu::BufferUsages::MAP_READ | nibble_wgpu::wgpu::BufferUsages::STORAGE;
    let e = b
        .create_buffer("test buffer", 4096, usage)
        .expect_err("invalid usage")
        .to_string();
    assert!(e.contains("test buffer (4096 bytes)"), "{e}");
}

#[test]
fn ops_are_submitted_in_batches() {
    let Some(mut b) = wgpu_or_absent("wgpu errors") else {
        return;
    };
    use nibble_core::backend::{host_words, layout_op};
    let x = HostTensor::f32(&[4, 8], random_values(32, 2)).expect("x");
    let lay = layout_op(&b, std::slice::from_ref(&x.info), &x.info, None, None);
    b.allocate(lay.arena_words, lay.pool_bytes, 0)
        .expect("allocate");
    b.write_arena(lay.inputs[0].slice, &host_words(&x))
        .expect("write");
    let before = b.submits();
    // 20 scalings by different factors back and forth between two values (each op has its own
    // parameters), then one read-back: one submit, not 20.
    let (a, c) = (lay.inputs[0].clone(), lay.out.clone());
    let factor = |i: usize| 0.75 + 0.05 * i as f32;
    for i in 0..20 {
        let (from, to) = if i % 2 == 0 { (&a, &c) } else { (&c, &a) };
        let op = OpKind::Scale { factor: factor(i) };
        Backend::run(&mut b, &op, std::slice::from_ref(from), None, to).expect("scale");
    }
    let words = b.read_arena(a.slice).expect("read");
    assert_eq!(b.submits() - before, 1, "20 ops, one submit");
    let mut want = x.as_f32().to_vec();
    for i in 0..20 {
        want.iter_mut().for_each(|v| *v *= factor(i));
    }
    let got: Vec<f32> = words.into_iter().map(f32::from_bits).collect();
    let err = nibble_tests::max_err_rel_to_max(&got, &want);
    assert!(
        err < 1e-5,
        "20 scalings in one batch, each with its factor: {err:e}"
    );
}
