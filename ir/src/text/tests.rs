//! Tests of the text format: the round-trip laws, the error messages, and that nothing panics.

use proptest::prelude::*;

use super::generate::{modules, modules_with_finite_floats};
use super::{parse_module, print_graph, print_module, print_module_annotated, print_node, Annotate, ParseError};
use crate::model::config::{Architecture, ConfigDtype, ModelConfig, RopeConfig, RopeScaling};
use crate::{Graph, Module, NodeId};

/// Canonical text using every op, multi-axis dims, partials, escapes, an inserted node (v16 before
/// v15) and a detached node.
const CANONICAL: &str = r#"; module tiny mesh=dp=2,tp=2
; a comment the printer does not keep
v0: i32[batch=8/dp, seq=64] = tokens()   # n0 tokens
v1: i32[seq=64] = positions()   # n1 positions
v2: f32[vocab=256/tp, hidden=128] = param() name="model.embed_tokens.weight"   # n2 model.embed_tokens.weight
v3: f32[batch=8/dp, seq=64, hidden=128] partial(tp) = embedding(v2, v0)   # n3 embed
v4: f32[batch=8/dp, seq=64, hidden=128] = all_reduce(v3) axis=tp   # n4 embed.all_reduce
v5: f32[hidden=128] = param() name="model.layers.0.input_layernorm.weight"   # n5 model.layers.0.input_layernorm.weight
v6: f32[batch=8/dp, seq=64, hidden=128] = rms_norm(v4, v5) eps=0.00001   # n6 layer0.attn_norm
v7: f32[heads=4/tp, head_dim=32, hidden=128] = param() name="q \"quoted\" \\ back"   # n7 layer0.q weight \\ with spaces
v8: f32[batch=8/dp, seq=64, heads=4/tp, head_dim=32] = matmul(v6, v7) contract=1   # n8 layer0.q
v9: f32[batch=8/dp, seq=64, heads=4/tp, head_dim=32] = rope(v8, v1) theta=500000 scaling=llama3(factor=8,low=1,high=4,original=8192)   # n9 layer0.q_rope
v10: f32[batch=8/dp, seq=64, heads=4/tp, head_dim=32] = rope(v8, v1) theta=10000   # n10
v11: f32[batch=8/dp, seq=64, heads=4/tp, head_dim=32] = attention(v9, v10, v10, v1, v1) causal=true   # n11 layer0.attention
v12: f32[hidden=128, heads=4/tp, head_dim=32] = param() name=""   # n12 layer0.o weight
v13: f32[batch=8/dp, seq=64, hidden=128] partial(tp) = matmul(v11, v12) contract=2   # n13 layer0.o_proj
v14: f32[batch=8/dp, seq=64/tp, hidden=128] = reduce_scatter(v13) axis=tp dim=seq   # n14 layer0.o_proj.reduce_scatter
v16: f32[batch=8/dp, seq=64/tp, hidden=128] = silu_mul(v14, v14)   # n16 inserted\nlater
v15: bf16[batch=8, seq=64/dp/tp, hidden=128] = add(v16, v14)   # n15 layer0.attn_residual
v17: f16[batch=8/dp, seq=64, hidden=128] = all_gather(v15) axis=tp dim=seq   # n17 layer0.all_gather
v18: f32[batch=8/dp, seq=64/tp, hidden=128] = local_slice(v17) axis=tp dim=seq   # n18 layer0.local_slice
v19: f32[] partial(dp,tp) = attention(v9, v10, v10, v1, v1) causal=false   # n19  leading space
outputs(v18, v17)
detached v20: f32[batch=8/dp, seq=64, hidden=128] = add(v4, v4)   # n20 dead.add
"#;

/// The canonical text without its comment line (the printer drops comments).
fn canonical() -> String {
    CANONICAL.lines().filter(|line| !line.starts_with("; a comment")).map(|line| format!("{line}\n")).collect()
}

/// A two-layer Llama with grouped-query attention and Llama 3 rope scaling.
fn tiny_llama() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 256,
        hidden_size: 64,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        intermediate_size: 128,
        rms_norm_eps: 1e-5,
        rope: RopeConfig {
            theta: 500000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position_embeddings: 8192,
            },
        },
        tie_word_embeddings: false,
        dtype: ConfigDtype::F32,
        attention_bias: false,
        max_position_embeddings: 131072,
        sliding_window: None,
        moe: None,
        name: "tiny-llama".to_string(),
    }
}

#[test]
fn canonical_text_round_trips() {
    let text = canonical();
    let module = parse_module(CANONICAL).unwrap();
    assert_eq!(print_module(&module), text);
    assert_eq!(print_module(&parse_module(&text).unwrap()), text);
}

#[test]
fn all_to_all_round_trips() {
    let text = format!(
        "{HEADER}v0: f32[seq=8, heads=4/tp] = param() name=\"x\"   # n0 x\n\
         v1: f32[seq=8/tp, heads=4] = all_to_all(v0) axis=tp split_dim=seq gather_dim=heads   # n1 reshard\n\
         outputs(v1)\n"
    );
    let module = parse_module(&text).unwrap();
    let node = module.graph.node(module.graph.order()[1]);
    assert_eq!(
        node.op,
        crate::Op::AllToAll {
            axis: crate::AxisName::Tp,
            split_dim: crate::DimName::Seq,
            gather_dim: crate::DimName::Heads
        }
    );
    assert_eq!(print_module(&module), text);
}

#[test]
fn parsed_module_matches_an_independent_reading() {
    let module = parse_module(CANONICAL).unwrap();
    let graph = &module.graph;
    assert_eq!(module.name, "tiny");
    assert_eq!(module.mesh.to_string(), "dp=2,tp=2");
    // Program order follows the lines, so the inserted n16 comes before n15; n20 is detached.
    let order: Vec<String> = graph.order().iter().map(ToString::to_string).collect();
    let expected: Vec<String> = (0..=14).chain([16, 15, 17, 18, 19]).map(|id| format!("n{id}")).collect();
    assert_eq!(order, expected);
    assert_eq!(graph.node_count(), 21);
    assert_eq!(format!("{:?}", graph.outputs()), "[v18, v17]");
    let node = |id: usize| graph.node(<NodeId as crate::entity::EntityRef>::new(id));
    assert_eq!(node(7).name, "layer0.q weight \\ with spaces");
    assert_eq!(node(7).op, crate::Op::Param { name: "q \"quoted\" \\ back".to_string() });
    assert_eq!(node(12).op, crate::Op::Param { name: String::new() });
    assert_eq!(node(10).name, "");
    assert_eq!(node(16).name, "inserted\nlater");
    assert_eq!(node(19).name, " leading space");
    assert_eq!(format!("{:?}", node(11).inputs), "[v9, v10, v10, v1, v1]");
    let v15 = graph.value(node(15).result);
    assert_eq!(v15.spec.dims, vec![vec![], vec![crate::AxisName::Dp, crate::AxisName::Tp], vec![]]);
    assert_eq!(v15.ty.dtype, crate::DType::Bf16);
    assert_eq!(graph.value(node(19).result).spec.partial, vec![crate::AxisName::Dp, crate::AxisName::Tp]);
    assert_eq!(graph.value(node(6).result).def.to_string(), "n6");
}

#[test]
fn empty_module_round_trips() {
    let text = "; module  mesh=\noutputs()\n";
    let module = parse_module(text).unwrap();
    assert_eq!(module, Module { name: String::new(), mesh: crate::Mesh::default(), graph: Graph::new() });
    assert_eq!(print_module(&module), text);
    assert_eq!(print_graph(&module.graph), "outputs()\n");
}

#[test]
fn hand_spacing_is_accepted() {
    let loose =
        "\r\n;module m mesh=tp=2\r\n  v0 :i32[ batch = 8 / tp ,seq=4]partial( tp )=tokens( )#n0\r\noutputs( v0 )\r\n";
    let module = parse_module(loose).unwrap();
    assert_eq!(
        print_module(&module),
        "; module m mesh=tp=2\nv0: i32[batch=8/tp, seq=4] partial(tp) = tokens()   # n0\noutputs(v0)\n"
    );
}

#[test]
fn real_model_round_trips() {
    let module = crate::model::build(&tiny_llama(), 2, 8).unwrap();
    let text = print_module(&module);
    assert_eq!(parse_module(&text).unwrap(), module);
    insta::assert_snapshot!("tiny_llama", text);
}

#[test]
fn module_round_trips_through_json() {
    let module = parse_module(CANONICAL).unwrap();
    let json = serde_json::to_string(&module).unwrap();
    assert_eq!(serde_json::from_str::<Module>(&json).unwrap(), module);
}

#[test]
fn annotations_are_comments_the_parser_skips() {
    struct Users;
    impl Annotate for Users {
        fn notes(&self, graph: &Graph, node: NodeId) -> Vec<String> {
            let users = graph.users(graph.node(node).result);
            if users.is_empty() {
                return Vec::new();
            }
            vec![format!("users: {users:?}\nand a second line")]
        }
    }
    let module = parse_module(CANONICAL).unwrap();
    let annotated = print_module_annotated(&module, &Users);
    assert!(annotated.contains("# n1 positions\n; users: [n9, n10, n11, n19]\n; and a second line\n"), "{annotated}");
    assert_eq!(parse_module(&annotated).unwrap(), module);
}

#[test]
fn print_node_is_the_printed_line() {
    let module = parse_module(CANONICAL).unwrap();
    let graph = &module.graph;
    let lines: Vec<String> = graph.order().iter().map(|&node| print_node(graph, node)).collect();
    let text = canonical();
    let printed: Vec<&str> = text.lines().skip(1).take(lines.len()).collect();
    assert_eq!(lines, printed);
}

/// Parses `text` expecting an error, and checks its rendered form and that its span lies in `text`.
#[track_caller]
fn check_error(text: &str, expected: &str) {
    let error = parse_module(text).unwrap_err();
    assert_eq!(error.to_string(), expected);
    assert!(text.get(error.offset..error.offset + error.len).is_some(), "span {error:?} outside the text");
}

const HEADER: &str = "; module m mesh=tp=2\n";

#[test]
fn errors_say_what_was_expected_and_where() {
    let ops = "tokens, positions, param, embedding, rms_norm, matmul, rope, attention, silu_mul, add, sum, \
               cross_entropy, cross_entropy_grad, vocab_parallel_cross_entropy, vocab_parallel_cross_entropy_grad, \
               matmul_grad_input, matmul_grad_weight, rms_norm_grad_input, rms_norm_grad_input_add, \
               rms_norm_grad_weight, rope_grad, attention_grad_query, attention_grad_key, attention_grad_value, \
               silu_mul_grad_gate, embedding_grad, sum_leading, all_reduce, reduce_scatter, all_gather, local_slice, \
               broadcast_shard, reduce_to_root, ring_gated_mlp, ring_gated_mlp_grad, ring_attention, zigzag, all_to_all, moe_mlp, moe_mlp_grad, sigmoid_scale, sigmoid_scale_grad_gate, expert_counts, router_prob_sum, router_prob_sum_grad, load_balancing_loss";
    check_error(
        &format!("{HEADER}v0: f32[seq=4] = tokens()\nv1: f32[seq=4] = rms_nrom(v0, v0) eps=1"),
        &format!("line 3, column 18: unknown op `rms_nrom`; ops are {ops}"),
    );
    check_error(
        "v0: f32[seq=4] = tokens()",
        "line 1, column 1: expected the module header `; module NAME mesh=MESH` before the first node, found `v0`",
    );
    check_error(
        "; just a comment\n",
        "line 2, column 1: missing the module header `; module NAME mesh=MESH`; start the text with it, e.g. `; module tiny mesh=tp=2`",
    );
    check_error(
        "; module m\n",
        "line 1, column 11: expected ` mesh=MESH` at the end of the module header, e.g. `; module tiny mesh=tp=2` (`mesh=` alone for one rank)",
    );
    check_error(
        "; module m mesh=tq=2\n",
        "line 1, column 17: mesh `tq=2`: unknown axis `tq`; axes are dp, tp, sp, cp, pp, tsp, ep",
    );
    check_error(
        &format!("{HEADER}v0: f33[seq=4] = tokens()"),
        "line 2, column 5: unknown dtype `f33`; dtypes are f32, bf16, f16, i32",
    );
    check_error(
        &format!("{HEADER}v0: f32[sq=4] = tokens()"),
        "line 2, column 9: unknown dim `sq`; dims are batch, seq, hidden, heads, kv_heads, head_dim, ffn, vocab, experts",
    );
    check_error(
        &format!("{HEADER}v0: f32[seq=4/tq] = tokens()"),
        "line 2, column 15: unknown axis `tq`; axes are dp, tp, sp, cp, pp, tsp, ep",
    );
    check_error(
        &format!("{HEADER}v0: f32[seq=x] = tokens()"),
        "line 2, column 13: expected a whole number for the size of dim `seq`, found `x`",
    );
    check_error(
        &format!("{HEADER}v0: f32[seq=4 = tokens()"),
        "line 2, column 15: expected `,` or `]` after dim `seq`, found `=`",
    );
    check_error(&format!("{HEADER}v0 f32[seq=4] = tokens()"), "line 2, column 4: expected `:` after `v0`, found `f32`");
    check_error(
        &format!("{HEADER}x0: f32[seq=4] = tokens()"),
        "line 2, column 1: expected a node line `v3: type = op(..)`, `outputs(..)` or a `;` comment, found `x0`",
    );
    check_error(&format!("{HEADER}v0: f32[] = add(v0)"), "line 2, column 16: add takes 2 operands, found 1");
    check_error(
        &format!("{HEADER}v0: f32[] = tokens() eps=1"),
        "line 2, column 22: unknown attribute `eps`; tokens takes no attributes",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = rms_norm(v0, v0)"),
        "line 2, column 13: rms_norm needs the attribute `eps=`, e.g. `eps=0.00001`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = rms_norm(v0, v0) eps=small"),
        "line 2, column 34: expected a number for `eps`, found `small`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = matmul(v0, v0) contract=300"),
        "line 2, column 37: expected a whole number from 0 to 255 for `contract`, found `300`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = all_reduce(v0) axis=tp axis=tp"),
        "line 2, column 36: attribute `axis` given twice; keep one",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = all_gather(v0) axis=tp dim=sq"),
        "line 2, column 40: unknown dim `sq`; dims are batch, seq, hidden, heads, kv_heads, head_dim, ffn, vocab, experts",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = param() name=\"abc"),
        "line 2, column 26: unterminated string; end it with `\"`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = param() name=\"a\\qb\""),
        "line 2, column 28: unknown escape `\\q`; escapes are \\\\, \\\", \\n and \\r (write `\\\\` for a backslash)",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = rope(v0, v0) theta=1 scaling=yarn(factor=2)"),
        "line 2, column 42: unknown rope scaling `yarn`; write `llama3(factor=8,low=1,high=4,original=8192)`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = rope(v0, v0) theta=1 scaling=llama3(factor=2,high=1)"),
        "line 2, column 58: expected `low=` in llama3(factor=..,low=..,high=..,original=..), found `high`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = tokens()   # n1 x"),
        "line 2, column 26: node n1 on the line of v0; node i defines value i, so write `# n0`",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = tokens()   #n0\tx"),
        "line 2, column 27: expected a space and the node name after the node id, found `\\t`",
    );
    check_error(
        &format!("{HEADER}v1: f32[] = tokens()"),
        "line 2, column 1: v1 is out of range; the 1 nodes must be numbered v0 to v0, each once",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = tokens()\nv0: f32[] = tokens()"),
        "line 3, column 1: v0 is defined twice (first on line 2); give each node its own id",
    );
    check_error(
        &format!("{HEADER}v0: f32[] = add(v0, v4)"),
        "line 2, column 21: operand v4 is not defined; the values are v0 to v0",
    );
    check_error(
        &format!("{HEADER}outputs(v0)"),
        "line 2, column 9: output v0 is not defined; this module has no nodes",
    );
    check_error(
        &format!("{HEADER}outputs()\noutputs()"),
        "line 3, column 1: a second `outputs(..)` line; the first is on line 2, list them all there",
    );
    check_error(
        &format!("{HEADER}v99999999999999999999999: f32[] = tokens()"),
        "line 2, column 1: id `v99999999999999999999999` is too large; ids count the nodes from 0",
    );
}

#[test]
fn errors_are_diagnostics_with_the_text() {
    use miette::Diagnostic;
    let text = format!("{HEADER}v0: f32[seq=4] = rms_nrom(v0, v0)\n");
    let error = parse_module(&text).unwrap_err();
    assert_eq!(error.code().map(|code| code.to_string()), Some("E0301".to_string()));
    let labels: Vec<miette::LabeledSpan> = error.labels().into_iter().flatten().collect();
    assert_eq!(labels.len(), 1);
    assert_eq!(&text[labels[0].offset()..labels[0].offset() + labels[0].len()], "rms_nrom");
    let mut rendered = String::new();
    miette::NarratableReportHandler::new().render_report(&mut rendered, &error).unwrap();
    assert!(rendered.contains("v0: f32[seq=4] = rms_nrom(v0, v0)"), "{rendered}");
    assert!(rendered.contains("E0301"), "{rendered}");
}

/// Checks what any parse must satisfy: a failure's place lies within the text and agrees with its
/// byte offset; a success prints to canonical text that reads back to the same thing.
fn check_parse_is_sound(text: &str) {
    match parse_module(text) {
        Err(ParseError { line, column, offset, len, .. }) => {
            assert!(text.get(offset..offset + len).is_some(), "span {offset}+{len} is not within the text");
            let line_start = text[..offset].rfind('\n').map_or(0, |newline| newline + 1);
            assert_eq!(line, text[..offset].matches('\n').count() + 1);
            assert_eq!(column, text[line_start..offset].chars().count() + 1);
        }
        Ok(module) => {
            let printed = print_module(&module);
            let reparsed = parse_module(&printed).unwrap_or_else(|error| panic!("{error}\n{printed}"));
            assert_eq!(print_module(&reparsed), printed);
        }
    }
}

/// One edit of a valid text: removes, inserts or replaces a piece, or moves, copies or drops a line.
fn mutate(text: &str, kind: usize, at: usize, other: usize, piece: &str) -> String {
    let boundaries: Vec<usize> = text.char_indices().map(|(index, _)| index).chain([text.len()]).collect();
    let start = boundaries[at % boundaries.len()];
    let end = boundaries[(at % boundaries.len() + other % 8).min(boundaries.len() - 1)];
    let mut lines: Vec<&str> = text.lines().collect();
    if lines.is_empty() {
        return format!("{piece}{text}");
    }
    let (first, second) = (at % lines.len(), other % lines.len());
    match kind % 6 {
        0 => format!("{}{}", &text[..start], &text[end..]),
        1 => format!("{}{piece}{}", &text[..start], &text[start..]),
        2 => format!("{}{piece}{}", &text[..start], &text[end..]),
        3 => {
            lines.swap(first, second);
            lines.join("\n")
        }
        4 => {
            let copied = lines[first];
            lines.insert(second, copied);
            lines.join("\n")
        }
        _ => {
            lines.remove(first);
            lines.join("\n")
        }
    }
}

/// Pieces of IR that make mutations hit the grammar rather than only break it.
fn piece() -> impl Strategy<Value = String> {
    prop_oneof![
        "[ -~]{0,6}",
        Just("v0".to_string()),
        Just("/tp".to_string()),
        Just(", seq=4".to_string()),
        Just(" partial(dp)".to_string()),
        Just("\"".to_string()),
        Just("\\".to_string()),
        Just("\n".to_string()),
        Just("é".to_string()),
        Just(" eps=1e-5".to_string()),
        Just("# n1".to_string()),
        Just("detached ".to_string()),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn parse_inverts_print(module in modules()) {
        let text = print_module(&module);
        let parsed = parse_module(&text).map_err(|error| TestCaseError::fail(format!("{error}\n{text}")))?;
        prop_assert_eq!(&parsed, &module, "{}", text);
        prop_assert_eq!(print_module(&parsed), text);
    }

    #[test]
    fn json_round_trips(module in modules_with_finite_floats()) {
        let json = serde_json::to_string(&module).unwrap();
        prop_assert_eq!(serde_json::from_str::<Module>(&json).unwrap(), module);
    }

    #[test]
    fn arbitrary_text_never_panics(text in any::<String>()) {
        check_parse_is_sound(&text);
    }

    #[test]
    fn ir_like_text_never_panics(text in "(; module m mesh=tp=2\n)?([ v0-9:=,()#\"\\\\/\\[\\]\nfi32bqspartilmdxoeuhtcn_.é]{0,80})") {
        check_parse_is_sound(&text);
    }

    #[test]
    fn mutated_text_never_panics(
        module in modules(),
        edits in prop::collection::vec((0..6usize, any::<usize>(), any::<usize>(), piece()), 1..4),
    ) {
        let mut text = print_module(&module);
        for (kind, at, other, piece) in &edits {
            text = mutate(&text, *kind, *at, *other, piece);
        }
        check_parse_is_sound(&text);
    }
}

/// The round-trip properties are only as strong as the generator: check that it reaches every op
/// and every feature of the format.
#[test]
fn generator_covers_every_op_and_feature() {
    use proptest::strategy::ValueTree;
    let strategy = modules();
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let mut ops = std::collections::BTreeSet::new();
    let mut features = std::collections::BTreeSet::new();
    for _ in 0..500 {
        let module = strategy.new_tree(&mut runner).unwrap().current();
        let graph = &module.graph;
        let order = graph.order();
        for &node in order {
            let data = graph.node(node);
            ops.insert(data.op.mnemonic());
            let spec = &graph.value(data.result).spec;
            if spec.dims.iter().any(|axes| axes.len() > 1) {
                features.insert("dim split over several axes");
            }
            if !spec.partial.is_empty() {
                features.insert("partial");
            }
            if data.name.contains('\n') || data.name.contains('\\') {
                features.insert("name with escapes");
            }
            if let crate::Op::Rope { rope } = &data.op {
                if rope.scaling != RopeScaling::None {
                    features.insert("rope scaling");
                }
            }
        }
        if order.windows(2).any(|pair| pair[0] > pair[1]) {
            features.insert("inserted node");
        }
        if order.len() < graph.node_count() {
            features.insert("detached node");
        }
        if !graph.outputs().is_empty() {
            features.insert("outputs");
        }
    }
    assert_eq!(ops.len(), 36, "ops reached: {ops:?}");
    assert_eq!(features.len(), 7, "features reached: {features:?}");
}

#[test]
fn ring_attention_round_trips() {
    let text = "; module m mesh=cp=2\n\
                v0: f32[batch=1, seq=8/cp, heads=2, head_dim=4] = param() name=\"q\"   # n0 q\n\
                v1: f32[batch=1, seq=8/cp, kv_heads=1, head_dim=4] = param() name=\"k\"   # n1 k\n\
                v2: i32[seq=8/cp] = positions()   # n2 positions\n\
                v3: f32[batch=1, seq=8/cp, heads=2, head_dim=4] = ring_attention(v0, v1, v1, v2, v2) axis=cp causal=true   # n3 attention\n\
                outputs(v3)\n";
    let module = parse_module(text).unwrap();
    let node = module.graph.node(<NodeId as crate::entity::EntityRef>::new(3));
    assert_eq!(node.op, crate::Op::RingAttention { axis: crate::AxisName::Cp, causal: true });
    assert_eq!(print_module(&module), text);
    let bad = text.replace("causal=true", "causal=maybe");
    let column = bad.lines().nth(4).and_then(|line| line.find("maybe")).expect("the line") + 1;
    check_error(&bad, &format!("line 5, column {column}: expected `true` or `false` for `causal`, found `maybe`"));
}
