//! Property tests of sharding propagation over random small models and meshes: the shard pipeline
//! either succeeds, and then every value's spec divides its shape and the verifier passes, or it
//! returns an error that names a mesh axis; it never panics. Models whose sizes divide by every
//! axis always compile (no spurious rejection).

use std::panic::{catch_unwind, AssertUnwindSafe};

use pleat_ir::model::config::{Architecture, ConfigDtype, ModelConfig, RopeConfig, RopeScaling};
use pleat_ir::{AxisName, Mesh, Module};
use proptest::prelude::*;

use crate::{run_pipeline, verify, PassCtx, SHARD_PIPELINE};

/// The sizes of a random model and its input.
#[derive(Clone, Debug)]
struct Sizes {
    vocab: u64,
    hidden: u64,
    layers: u64,
    kv_heads: u64,
    /// Query heads a kv head serves.
    group: u64,
    head_dim: u64,
    ffn: u64,
    batch: u64,
    seq: u64,
    qwen2: bool,
    tie: bool,
}

fn config(sizes: &Sizes) -> ModelConfig {
    let architecture = if sizes.qwen2 { Architecture::Qwen2 } else { Architecture::Llama };
    ModelConfig {
        architecture,
        vocab_size: sizes.vocab,
        hidden_size: sizes.hidden,
        num_layers: sizes.layers,
        num_heads: sizes.kv_heads * sizes.group,
        num_kv_heads: sizes.kv_heads,
        head_dim: sizes.head_dim,
        intermediate_size: sizes.ffn,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None },
        tie_word_embeddings: sizes.tie,
        dtype: ConfigDtype::F32,
        attention_bias: sizes.qwen2,
        max_position_embeddings: 4096,
        sliding_window: None,
        moe: None,
        name: "random".to_owned(),
    }
}

/// A size that is often, but not always, a multiple of small degrees: a small factor times 1, 2,
/// 3, 4, 6 or 8.
fn size(max_factor: u64) -> impl Strategy<Value = u64> {
    (1..=max_factor, prop::sample::select(vec![1u64, 2, 3, 4, 6, 8])).prop_map(|(factor, multiple)| factor * multiple)
}

/// Sizes drawn freely: many of them do not divide by a random mesh.
fn any_sizes() -> impl Strategy<Value = Sizes> {
    (
        (size(6), size(4), 1u64..=2, size(2), 1u64..=3, 1u64..=4),
        (size(5), size(2), size(3), any::<bool>(), any::<bool>()),
    )
        .prop_map(|((vocab, hidden, layers, kv_heads, group, half_head_dim), (ffn, batch, seq, qwen2, tie))| {
            Sizes { vocab, hidden, layers, kv_heads, group, head_dim: 2 * half_head_dim, ffn, batch, seq, qwen2, tie }
        })
}

/// Sizes that every split of a mesh of `ranks` ranks divides: each split dim is a multiple of the
/// world size, and the sequence of twice it (context parallelism's zigzag halves).
fn dividing_sizes(ranks: u64) -> impl Strategy<Value = Sizes> {
    (
        (1u64..=3, 1u64..=3, 1u64..=2, 1u64..=2, 1u64..=2, 1u64..=3),
        (1u64..=3, 1u64..=2, 1u64..=2, any::<bool>(), any::<bool>()),
    )
        .prop_map(
            move |((vocab, hidden, layers, kv_heads, group, half_head_dim), (ffn, batch, seq, qwen2, tie))| Sizes {
                vocab: vocab * ranks,
                hidden: hidden * ranks,
                layers,
                kv_heads: kv_heads * ranks,
                group,
                head_dim: 2 * half_head_dim,
                ffn: ffn * ranks,
                batch: batch * ranks,
                seq: seq * 2 * ranks,
                qwen2,
                tie,
            },
        )
}

/// A mesh and whether `tp` runs with sequence parallelism (`--strategy tp-sp`).
#[derive(Clone, Debug)]
struct Plan {
    axes: Vec<(AxisName, u64)>,
    sequence_parallel: bool,
}

impl Plan {
    fn mesh(&self) -> Mesh {
        Mesh::new(&self.axes).expect("distinct axes of positive degree")
    }
    fn ranks(&self) -> u64 {
        self.axes.iter().map(|(_, degree)| degree).product()
    }
}

const AXES: [AxisName; 4] = [AxisName::Tp, AxisName::Dp, AxisName::Cp, AxisName::Tsp];

/// Whether `axes` pair `tsp` with an axis it cannot share a mesh with: `cp` (both split the
/// sequence; `fold-cp` refuses the pair) or `tp` (both split the weights; propagation finds no layout
/// for the tsp ring).
fn conflicting(axes: &[(AxisName, u64)]) -> bool {
    let has = |name: AxisName| axes.iter().any(|(axis, _)| *axis == name);
    has(AxisName::Tsp) && (has(AxisName::Cp) || has(AxisName::Tp))
}

/// One or two distinct axes of degree 1 to `max_degree`, `tp` with or without sequence
/// parallelism; `compatible` leaves out the pairs that cannot share a mesh (`conflicting`).
fn plans(max_degree: u64, compatible: bool) -> impl Strategy<Value = Plan> {
    let one = (0..AXES.len(), 1..=max_degree).prop_map(|(axis, degree)| vec![(AXES[axis], degree)]);
    let two = (0..AXES.len(), 1..AXES.len(), 1..=max_degree, 1..=max_degree)
        .prop_map(|(first, offset, first_degree, second_degree)| {
            vec![(AXES[first], first_degree), (AXES[(first + offset) % AXES.len()], second_degree)]
        })
        .prop_filter("tsp shares a mesh with neither cp nor tp", move |axes| !compatible || !conflicting(axes));
    (prop_oneof![one, two], any::<bool>()).prop_map(|(axes, sequence_parallel)| {
        let has_tp = axes.iter().any(|(axis, _)| *axis == AxisName::Tp);
        Plan { axes, sequence_parallel: sequence_parallel && has_tp }
    })
}

/// Builds `sizes`' forward graph and runs the shard pipeline on `plan`'s mesh. A panic anywhere is
/// turned into `Err` with the panic's message, so that a property fails on it instead of aborting.
fn compile(sizes: &Sizes, plan: &Plan) -> Result<Result<Module, String>, String> {
    let config = config(sizes);
    let mesh = plan.mesh();
    let ctx = PassCtx { sequence_parallel: plan.sequence_parallel, ..PassCtx::default() };
    catch_unwind(AssertUnwindSafe(|| {
        let mut module = pleat_ir::model::build(&config, sizes.batch, sizes.seq).map_err(|error| error.to_string())?;
        module.mesh = mesh.clone();
        run_pipeline(SHARD_PIPELINE, &mut module, &ctx).map_err(|error| error.to_string())?;
        Ok(module)
    }))
    .map_err(|panic| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|text| text.to_string()))
            .unwrap_or_default();
        format!("panicked: {message}")
    })
}

/// Every value whose spec splits a dim over axes whose degrees do not divide it, or whose spec has
/// a different number of dims than its shape, computed from the degrees directly.
fn indivisible_values(module: &Module) -> Vec<String> {
    let graph = &module.graph;
    let mut bad = Vec::new();
    for &node in graph.order() {
        let node = graph.node(node);
        let value = graph.value(node.result);
        let dims = value.ty.shape.dims();
        if value.spec.dims.len() != dims.len() {
            bad.push(format!("{}: spec of {} dims on a shape of {}", node.name, value.spec.dims.len(), dims.len()));
            continue;
        }
        for (dim, axes) in dims.iter().zip(&value.spec.dims) {
            let degree: u64 = axes.iter().map(|&axis| module.mesh.axis(axis).map_or(0, |axis| axis.size)).product();
            if degree == 0 || dim.size % degree != 0 {
                bad.push(format!(
                    "{}: {} of {} split over {axes:?} (degree {degree})",
                    node.name,
                    dim.name.as_str(),
                    dim.size
                ));
            }
        }
    }
    bad
}

/// Checks a successful compile: every spec divides its shape and the verifier passes.
fn check_compiled(module: &Module) -> Result<(), TestCaseError> {
    let bad = indivisible_values(module);
    prop_assert!(bad.is_empty(), "specs that do not divide their shapes: {:?}", bad);
    prop_assert!(verify(module).is_ok(), "the verifier rejects the result: {:?}", verify(module).err());
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    /// Any model on any mesh: a sharded module whose specs all divide, or an error that names one
    /// of the mesh's axes; never a panic, never a verifier failure.
    #[test]
    fn propagation_divides_every_shape_or_names_the_axis(sizes in any_sizes(), plan in plans(8, false)) {
        match compile(&sizes, &plan).map_err(TestCaseError::fail)? {
            Ok(module) => check_compiled(&module)?,
            Err(message) => {
                prop_assert!(!message.contains("the IR is invalid after pass"), "a pass broke the IR: {}", message);
                let names_axis = plan.axes.iter().any(|(axis, _)| message.contains(axis.as_str()));
                prop_assert!(names_axis, "the error names no axis of {:?}: {}", plan.axes, message);
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, failure_persistence: None, ..ProptestConfig::default() })]

    /// Models whose every split dim divides by the world size always compile, on every mesh whose
    /// axes can be combined.
    #[test]
    fn dividing_models_always_compile(
        (plan, sizes) in plans(4, true).prop_flat_map(|plan| {
            let ranks = plan.ranks();
            (Just(plan), dividing_sizes(ranks))
        })
    ) {
        match compile(&sizes, &plan).map_err(TestCaseError::fail)? {
            Ok(module) => check_compiled(&module)?,
            Err(message) => prop_assert!(false, "a dividing model was rejected: {}", message),
        }
    }
}
