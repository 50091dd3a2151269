//! The parser: text in the printer's format back to a `Module`.
//!
//! It reads line by line (each line is parsed on its own), then checks the structure across lines:
//! the value ids run over `0..n` exactly once, each line's node id equals its value id, and every
//! operand and output names a value some line defines. It checks nothing a well-formed `Graph` could
//! still get wrong (shapes, specs, def-before-use): that is the verifier's job. It stops at the first
//! problem it finds, and nothing panics.

use super::cursor::{Cursor, Parsed};
use super::error::{ParseError, Span};
use crate::entity::EntityRef;
use crate::model::config::{RopeConfig, RopeScaling};
use crate::{
    AxisName, DType, Dim, DimName, Graph, Mesh, MlpOperand, Module, MoeOperand, NodeData, NodeId, Op, Shape, ShardSpec,
};
use crate::{TensorType, ValueData, ValueId};

/// Every op's mnemonic, in `Op`'s order: what an unknown op's error lists.
const OPS: [&str; 46] = [
    "tokens",
    "positions",
    "param",
    "embedding",
    "rms_norm",
    "matmul",
    "rope",
    "attention",
    "silu_mul",
    "add",
    "sum",
    "cross_entropy",
    "cross_entropy_grad",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_cross_entropy_grad",
    "matmul_grad_input",
    "matmul_grad_weight",
    "rms_norm_grad_input",
    "rms_norm_grad_input_add",
    "rms_norm_grad_weight",
    "rope_grad",
    "attention_grad_query",
    "attention_grad_key",
    "attention_grad_value",
    "silu_mul_grad_gate",
    "embedding_grad",
    "sum_leading",
    "all_reduce",
    "reduce_scatter",
    "all_gather",
    "local_slice",
    "broadcast_shard",
    "reduce_to_root",
    "ring_gated_mlp",
    "ring_gated_mlp_grad",
    "ring_attention",
    "zigzag",
    "all_to_all",
    "moe_mlp",
    "moe_mlp_grad",
    "sigmoid_scale",
    "sigmoid_scale_grad_gate",
    "expert_counts",
    "router_prob_sum",
    "router_prob_sum_grad",
    "load_balancing_loss",
];

/// The header every module text needs, as errors spell it.
const HEADER: &str = "the module header `; module NAME mesh=MESH`";

/// Parses the text of a module, as `print_module` writes it.
pub fn parse_module(source: &str) -> Result<Module, ParseError> {
    parse(source).map_err(|error| error.with_source(source))
}

/// A node line, read but not yet checked against the other lines.
struct NodeLine {
    /// Whether the line starts with `detached` (the node is outside the program order).
    detached: bool,
    value: usize,
    value_span: Span,
    ty: TensorType,
    spec: ShardSpec,
    op: Op,
    inputs: Vec<(usize, Span)>,
    name: String,
}

fn parse(source: &str) -> Parsed<Module> {
    let mut header: Option<(String, Mesh)> = None;
    let mut lines: Vec<NodeLine> = Vec::new();
    let mut outputs: Option<(Vec<(usize, Span)>, Span)> = None;
    let mut offset = 0;
    for (index, raw) in source.split('\n').enumerate() {
        let line = raw.strip_suffix('\r').unwrap_or(raw);
        let mut cursor = Cursor::new(line, offset, index + 1);
        offset += raw.len() + 1;
        if cursor.at_end() {
            continue;
        }
        if cursor.rest().starts_with(';') {
            if header.is_none() && is_header(cursor.rest()) {
                header = Some(parse_header(&mut cursor)?);
            }
            continue;
        }
        if header.is_none() {
            return Err(cursor.expected(&format!("{HEADER} before the first node")));
        }
        let start = cursor.pos();
        if cursor.eat_keyword("outputs") {
            let keyword = cursor.span(start, cursor.pos());
            if let Some((_, first)) = &outputs {
                return Err(ParseError::at(
                    keyword,
                    format!("a second `outputs(..)` line; the first is on line {}, list them all there", first.line),
                ));
            }
            cursor.expect("(", "after `outputs`")?;
            let list = operand_list(&mut cursor, "an output like `v3`")?.0;
            if !cursor.at_end() {
                return Err(cursor.expected("end of line after `outputs(..)`"));
            }
            outputs = Some((list, keyword));
        } else {
            lines.push(node_line(&mut cursor)?);
        }
    }
    let Some((name, mesh)) = header else {
        let line = source.split('\n').count();
        let last_line_start = source.rfind('\n').map_or(0, |newline| newline + 1);
        let end = Cursor::new(&source[last_line_start..], last_line_start, line);
        let span = end.span(source.len() - last_line_start, source.len() - last_line_start);
        return Err(ParseError::at(
            span,
            format!("missing {HEADER}; start the text with it, e.g. `; module tiny mesh=tp=2`"),
        ));
    };
    let graph = assemble(lines, outputs.map(|(list, _)| list).unwrap_or_default())?;
    Ok(Module { name, mesh, graph })
}

/// Whether a comment line is the header: `;`, then the word `module` and a space or the line's end.
fn is_header(line: &str) -> bool {
    let after = line.trim_start_matches(';').trim_start_matches([' ', '\t']);
    after.strip_prefix("module").is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '\t']))
}

/// `; module NAME mesh=MESH`: the name is everything up to the last ` mesh=`, which no mesh contains.
fn parse_header(cursor: &mut Cursor<'_>) -> Parsed<(String, Mesh)> {
    cursor.expect(";", "")?;
    cursor.expect("module", "")?;
    let rest = cursor.rest();
    let Some((name, mesh_text)) = rest.rsplit_once(" mesh=") else {
        let end = cursor.pos() + rest.len();
        return Err(cursor.error(
            end,
            end,
            "expected ` mesh=MESH` at the end of the module header, e.g. `; module tiny mesh=tp=2` (`mesh=` alone for one rank)",
        ));
    };
    let name_start = cursor.pos() + usize::from(name.starts_with(' '));
    let name_end = cursor.pos() + name.len();
    let name = cursor.sub(name_start, name_end).rest_unescaped()?;
    let mesh_start = name_end + " mesh=".len();
    let mesh = Mesh::parse(mesh_text)
        .map_err(|error| cursor.error(mesh_start, mesh_start + mesh_text.len(), error.to_string()))?;
    Ok((name, mesh))
}

/// `[detached] v3: f32[seq=64/tp] partial(dp) = op(v1, v2) key=value   # n3 name`.
fn node_line(cursor: &mut Cursor<'_>) -> Parsed<NodeLine> {
    let detached = cursor.eat_keyword("detached");
    let (value, value_span) = cursor.id('v', "a node line `v3: type = op(..)`, `outputs(..)` or a `;` comment")?;
    cursor.expect(":", &format!("after `v{value}`"))?;
    let (ty, spec) = tensor_type(cursor)?;
    cursor.expect("=", "before the op")?;
    let (mnemonic, op_start) = cursor.word("an op name like `matmul`")?;
    let op_end = cursor.pos();
    if !OPS.contains(&mnemonic) {
        return Err(cursor.error(op_start, op_end, format!("unknown op `{mnemonic}`; ops are {}", OPS.join(", "))));
    }
    cursor.expect("(", &format!("after `{mnemonic}`"))?;
    let list_start = cursor.pos() - 1;
    let (inputs, list_end) = operand_list(cursor, "an operand like `v3`")?;
    let attributes = attribute_list(cursor)?;
    let op = build_op(cursor, mnemonic, (op_start, op_end), &attributes)?;
    if inputs.len() != op.arity() {
        let message = format!("{mnemonic} takes {} operands, found {}", op.arity(), inputs.len());
        return Err(cursor.error(list_start, list_end, message));
    }
    let mut name = String::new();
    if cursor.eat("#") {
        let (node, node_span) = cursor.id('n', "the node id after `#`, like `n3`")?;
        if node != value {
            let message =
                format!("node n{node} on the line of v{value}; node i defines value i, so write `# n{value}`");
            return Err(ParseError::at(node_span, message));
        }
        name = cursor.node_name()?;
    }
    Ok(NodeLine { detached, value, value_span, ty, spec, op, inputs, name })
}

/// Ids after an opening `(` (already read) up to `)`: the ids and the byte position after `)`.
fn operand_list(cursor: &mut Cursor<'_>, expected: &str) -> Parsed<(Vec<(usize, Span)>, usize)> {
    let mut ids = Vec::new();
    if !cursor.eat(")") {
        loop {
            let (id, span) = cursor.id('v', expected)?;
            ids.push((id, span));
            if cursor.eat(")") {
                break;
            }
            if !cursor.eat(",") {
                return Err(cursor.expected(&format!("`,` or `)` after v{id}")));
            }
        }
    }
    Ok((ids, cursor.pos()))
}

/// `f32[batch=8/dp/cp, seq=64] partial(tp)`.
fn tensor_type(cursor: &mut Cursor<'_>) -> Parsed<(TensorType, ShardSpec)> {
    let (dtype_text, start) = cursor.word("a dtype like `f32`")?;
    let dtype = DType::parse(dtype_text).ok_or_else(|| {
        let names: Vec<&str> = DType::ALL.iter().map(|dtype| dtype.as_str()).collect();
        cursor.error(start, cursor.pos(), format!("unknown dtype `{dtype_text}`; dtypes are {}", names.join(", ")))
    })?;
    cursor.expect("[", &format!("after `{dtype_text}`"))?;
    let mut dims = Vec::new();
    let mut spec = ShardSpec::default();
    if !cursor.eat("]") {
        loop {
            let (name_text, start) = cursor.word("a dim like `seq=64`")?;
            let name = DimName::parse(name_text).ok_or_else(|| {
                let names: Vec<&str> = DimName::ALL.iter().map(|name| name.as_str()).collect();
                cursor.error(start, cursor.pos(), format!("unknown dim `{name_text}`; dims are {}", names.join(", ")))
            })?;
            cursor.expect("=", &format!("after dim `{name}`"))?;
            let size = cursor.integer(&format!("the size of dim `{name}`"))?;
            let mut axes = Vec::new();
            while cursor.eat("/") {
                axes.push(axis(cursor)?);
            }
            dims.push(Dim { name, size });
            spec.dims.push(axes);
            if cursor.eat("]") {
                break;
            }
            if !cursor.eat(",") {
                return Err(cursor.expected(&format!("`,` or `]` after dim `{name}`")));
            }
        }
    }
    if cursor.eat_keyword("partial") {
        cursor.expect("(", "after `partial`")?;
        loop {
            spec.partial.push(axis(cursor)?);
            if cursor.eat(")") {
                break;
            }
            if !cursor.eat(",") {
                return Err(cursor.expected("`,` or `)` after an axis of `partial(..)`"));
            }
        }
    }
    Ok((TensorType { dtype, shape: Shape(dims) }, spec))
}

fn axis(cursor: &mut Cursor<'_>) -> Parsed<AxisName> {
    let (text, start) = cursor.word("a mesh axis like `tp`")?;
    parse_axis(cursor, text, (start, cursor.pos()))
}

/// The axis spelled `text`, which stands at bytes `span` of the line.
fn parse_axis(cursor: &Cursor<'_>, text: &str, span: (usize, usize)) -> Parsed<AxisName> {
    AxisName::parse(text).ok_or_else(|| {
        let names: Vec<&str> = AxisName::ALL.iter().map(|axis| axis.as_str()).collect();
        cursor.error(span.0, span.1, format!("unknown axis `{text}`; axes are {}", names.join(", ")))
    })
}

/// One `key=value` after the operands; `value` is unescaped when it was quoted.
struct Attribute<'a> {
    key: &'a str,
    key_start: usize,
    value: String,
    value_start: usize,
    value_end: usize,
}

/// The `key=value` attributes up to `#` or the line's end.
fn attribute_list<'a>(cursor: &mut Cursor<'a>) -> Parsed<Vec<Attribute<'a>>> {
    let mut attributes: Vec<Attribute<'a>> = Vec::new();
    while !cursor.at_end() && !cursor.rest().starts_with('#') {
        let (key, key_start) = cursor.word("an attribute `key=value` or the comment `# n<id> <name>`")?;
        if attributes.iter().any(|attribute| attribute.key == key) {
            return Err(cursor.error(key_start, cursor.pos(), format!("attribute `{key}` given twice; keep one")));
        }
        cursor.expect("=", &format!("after attribute `{key}`"))?;
        cursor.skip_spaces();
        let value_start = cursor.pos();
        let value = if cursor.rest().starts_with('"') {
            cursor.quoted()?
        } else {
            let (text, _) = cursor.bare_token();
            if text.is_empty() {
                return Err(cursor.expected(&format!("a value after `{key}=`")));
            }
            text.to_string()
        };
        attributes.push(Attribute { key, key_start, value, value_start, value_end: cursor.pos() });
    }
    Ok(attributes)
}

/// The op `mnemonic` (a known one) with its attributes; `op_span` is where its name stands.
fn build_op(cursor: &Cursor<'_>, mnemonic: &str, op_span: (usize, usize), attributes: &[Attribute<'_>]) -> Parsed<Op> {
    let allowed: &[&str] = match mnemonic {
        "param" => &["name"],
        "rms_norm" => &["eps"],
        "matmul" => &["contract"],
        "rope" => &["theta", "scaling"],
        "attention" => &["causal"],
        "all_reduce" | "ring_gated_mlp" | "vocab_parallel_cross_entropy" | "vocab_parallel_cross_entropy_grad" => {
            &["axis"]
        }
        "reduce_scatter" | "all_gather" | "local_slice" => &["axis", "dim"],
        "broadcast_shard" | "reduce_to_root" => &["axis", "dim", "root"],
        "zigzag" => &["parts", "inverse"],
        "matmul_grad_input" | "matmul_grad_weight" => &["contract"],
        "rms_norm_grad_input" | "rms_norm_grad_weight" | "rms_norm_grad_input_add" => &["eps"],
        "sum" => &["terms"],
        "rope_grad" => &["theta", "scaling"],
        "attention_grad_query" | "attention_grad_key" | "attention_grad_value" => &["causal"],
        "embedding_grad" => &["vocab"],
        "sum_leading" => &["keep"],
        "ring_attention" => &["axis", "causal"],
        "ring_gated_mlp_grad" => &["axis", "wrt"],
        "moe_mlp" => &["top_k", "normalize", "dispatch"],
        "expert_counts" => &["top_k", "scale"],
        "router_prob_sum_grad" => &["wrt"],
        "moe_mlp_grad" => &["top_k", "normalize", "dispatch", "wrt"],
        "all_to_all" => &["axis", "split_dim", "gather_dim"],
        _ => &[],
    };
    if let Some(unknown) = attributes.iter().find(|attribute| !allowed.contains(&attribute.key)) {
        let takes = match allowed {
            [] => "no attributes".to_string(),
            keys => keys.iter().map(|key| format!("`{key}=`")).collect::<Vec<_>>().join(" and "),
        };
        let end = unknown.key_start + unknown.key.len();
        return Err(cursor.error(
            unknown.key_start,
            end,
            format!("unknown attribute `{}`; {mnemonic} takes {takes}", unknown.key),
        ));
    }
    let required = |key: &str, example: &str| {
        attributes.iter().find(|attribute| attribute.key == key).ok_or_else(|| {
            cursor.error(
                op_span.0,
                op_span.1,
                format!("{mnemonic} needs the attribute `{key}=`, e.g. `{key}={example}`"),
            )
        })
    };
    let op = match mnemonic {
        "tokens" => Op::Tokens,
        "positions" => Op::Positions,
        "param" => Op::Param { name: required("name", "\"model.norm.weight\"")?.value.clone() },
        "embedding" => Op::Embedding,
        "rms_norm" => Op::RmsNorm { eps: number(cursor, required("eps", "0.00001")?, "a number")? },
        "matmul" => {
            Op::MatMul { contract: number(cursor, required("contract", "1")?, "a whole number from 0 to 255")? }
        }
        "rope" | "rope_grad" => {
            let theta = number(cursor, required("theta", "10000")?, "a number")?;
            let scaling = match attributes.iter().find(|attribute| attribute.key == "scaling") {
                None => RopeScaling::None,
                Some(attribute) => scaling(&mut cursor.sub(attribute.value_start, attribute.value_end))?,
            };
            let rope = RopeConfig { theta, scaling };
            if mnemonic == "rope" {
                Op::Rope { rope }
            } else {
                Op::RopeGrad { rope }
            }
        }
        "attention" => Op::Attention { causal: number(cursor, required("causal", "true")?, "`true` or `false`")? },
        "silu_mul" => Op::SiluMul,
        "add" => Op::Add,
        "cross_entropy" => Op::CrossEntropy,
        "cross_entropy_grad" => Op::CrossEntropyGrad,
        "matmul_grad_input" => Op::MatMulGradInput {
            contract: number(cursor, required("contract", "1")?, "a whole number from 0 to 255")?,
        },
        "matmul_grad_weight" => Op::MatMulGradWeight {
            contract: number(cursor, required("contract", "1")?, "a whole number from 0 to 255")?,
        },
        "rms_norm_grad_input" => Op::RmsNormGradInput { eps: number(cursor, required("eps", "0.00001")?, "a number")? },
        "rms_norm_grad_weight" => {
            Op::RmsNormGradWeight { eps: number(cursor, required("eps", "0.00001")?, "a number")? }
        }
        "attention_grad_query" => {
            Op::AttentionGradQuery { causal: number(cursor, required("causal", "true")?, "`true` or `false`")? }
        }
        "attention_grad_key" => {
            Op::AttentionGradKey { causal: number(cursor, required("causal", "true")?, "`true` or `false`")? }
        }
        "attention_grad_value" => {
            Op::AttentionGradValue { causal: number(cursor, required("causal", "true")?, "`true` or `false`")? }
        }
        "silu_mul_grad_gate" => Op::SiluMulGradGate,
        "sigmoid_scale" => Op::SigmoidScale,
        "expert_counts" => Op::ExpertCounts {
            top_k: number(cursor, required("top_k", "2")?, "a whole number")?,
            scale: number(cursor, required("scale", "0.02")?, "a number")?,
        },
        "router_prob_sum" => Op::RouterProbSum,
        "router_prob_sum_grad" => Op::RouterProbSumGrad { wrt: moe_operand_value(cursor, required("wrt", "router")?)? },
        "load_balancing_loss" => Op::LoadBalancingLoss,
        "sigmoid_scale_grad_gate" => Op::SigmoidScaleGradGate,
        "embedding_grad" => Op::EmbeddingGrad { vocab: number(cursor, required("vocab", "32000")?, "a whole number")? },
        "rms_norm_grad_input_add" => {
            Op::RmsNormGradInputAdd { eps: number(cursor, required("eps", "0.00001")?, "a number")? }
        }
        "sum" => Op::Sum { terms: number(cursor, required("terms", "3")?, "a whole number from 3 to 255")? },
        "sum_leading" => {
            Op::SumLeading { keep: number(cursor, required("keep", "1")?, "a whole number from 0 to 255")? }
        }
        "all_reduce" => Op::AllReduce { axis: axis_value(cursor, required("axis", "tp")?)? },
        "ring_gated_mlp" => Op::RingGatedMlp { axis: axis_value(cursor, required("axis", "tsp")?)? },
        "ring_gated_mlp_grad" => Op::RingGatedMlpGrad {
            axis: axis_value(cursor, required("axis", "tsp")?)?,
            wrt: mlp_operand_value(cursor, required("wrt", "gate")?)?,
        },
        "moe_mlp" | "moe_mlp_grad" => {
            let top_k = number(cursor, required("top_k", "2")?, "a whole number")?;
            let normalize = number(cursor, required("normalize", "true")?, "`true` or `false`")?;
            // Absent: each rank runs its experts on its own rows.
            let dispatch = match attributes.iter().find(|attribute| attribute.key == "dispatch") {
                None => None,
                Some(attribute) => Some(axis_value(cursor, attribute)?),
            };
            match mnemonic {
                "moe_mlp" => Op::MoeMlp { top_k, normalize, dispatch },
                _ => Op::MoeMlpGrad {
                    top_k,
                    normalize,
                    dispatch,
                    wrt: moe_operand_value(cursor, required("wrt", "router")?)?,
                },
            }
        }
        "vocab_parallel_cross_entropy" => {
            Op::VocabParallelCrossEntropy { axis: axis_value(cursor, required("axis", "tp")?)? }
        }
        "vocab_parallel_cross_entropy_grad" => {
            Op::VocabParallelCrossEntropyGrad { axis: axis_value(cursor, required("axis", "tp")?)? }
        }
        "zigzag" => Op::Zigzag {
            parts: number(cursor, required("parts", "4")?, "a whole number")?,
            inverse: number(cursor, required("inverse", "false")?, "`true` or `false`")?,
        },
        "ring_attention" => Op::RingAttention {
            axis: axis_value(cursor, required("axis", "cp")?)?,
            causal: number(cursor, required("causal", "true")?, "`true` or `false`")?,
        },
        "all_to_all" => Op::AllToAll {
            axis: axis_value(cursor, required("axis", "tp")?)?,
            split_dim: dim_value(cursor, required("split_dim", "seq")?)?,
            gather_dim: dim_value(cursor, required("gather_dim", "heads")?)?,
        },
        "broadcast_shard" => Op::BroadcastShard {
            axis: axis_value(cursor, required("axis", "tsp")?)?,
            dim: dim_value(cursor, required("dim", "heads")?)?,
            root: number(cursor, required("root", "0")?, "a whole number")?,
        },
        "reduce_to_root" => Op::ReduceToRoot {
            axis: axis_value(cursor, required("axis", "tsp")?)?,
            dim: dim_value(cursor, required("dim", "heads")?)?,
            root: number(cursor, required("root", "0")?, "a whole number")?,
        },
        _ => {
            let axis = axis_value(cursor, required("axis", "tp")?)?;
            let dim = dim_value(cursor, required("dim", "seq")?)?;
            match mnemonic {
                "reduce_scatter" => Op::ReduceScatter { axis, dim },
                "all_gather" => Op::AllGather { axis, dim },
                _ => Op::LocalSlice { axis, dim },
            }
        }
    };
    Ok(op)
}

/// An attribute's value read with `FromStr` (numbers and booleans); `expected` describes it.
fn number<T: std::str::FromStr>(cursor: &Cursor<'_>, attribute: &Attribute<'_>, expected: &str) -> Parsed<T> {
    attribute.value.parse().map_err(|_| {
        let message = format!("expected {expected} for `{}`, found `{}`", attribute.key, attribute.value);
        cursor.error(attribute.value_start, attribute.value_end, message)
    })
}

fn axis_value(cursor: &Cursor<'_>, attribute: &Attribute<'_>) -> Parsed<AxisName> {
    parse_axis(cursor, &attribute.value, (attribute.value_start, attribute.value_end))
}

fn mlp_operand_value(cursor: &Cursor<'_>, attribute: &Attribute<'_>) -> Parsed<MlpOperand> {
    MlpOperand::parse(&attribute.value).ok_or_else(|| {
        let names: Vec<&str> = MlpOperand::ALL.iter().map(|operand| operand.as_str()).collect();
        let message = format!("unknown MLP operand `{}`; operands are {}", attribute.value, names.join(", "));
        cursor.error(attribute.value_start, attribute.value_end, message)
    })
}

fn moe_operand_value(cursor: &Cursor<'_>, attribute: &Attribute<'_>) -> Parsed<MoeOperand> {
    MoeOperand::parse(&attribute.value).ok_or_else(|| {
        let names: Vec<&str> = MoeOperand::ALL.iter().map(|operand| operand.as_str()).collect();
        let message = format!("unknown MoE operand `{}`; operands are {}", attribute.value, names.join(", "));
        cursor.error(attribute.value_start, attribute.value_end, message)
    })
}

fn dim_value(cursor: &Cursor<'_>, attribute: &Attribute<'_>) -> Parsed<DimName> {
    DimName::parse(&attribute.value).ok_or_else(|| {
        let names: Vec<&str> = DimName::ALL.iter().map(|name| name.as_str()).collect();
        let message = format!("unknown dim `{}`; dims are {}", attribute.value, names.join(", "));
        cursor.error(attribute.value_start, attribute.value_end, message)
    })
}

/// `llama3(factor=8,low=1,high=4,original=8192)`, the fields in this order.
fn scaling(cursor: &mut Cursor<'_>) -> Parsed<RopeScaling> {
    const FORM: &str = "llama3(factor=8,low=1,high=4,original=8192)";
    let (kind, start) = cursor.word(&format!("a rope scaling like `{FORM}`"))?;
    if kind != "llama3" {
        return Err(cursor.error(start, cursor.pos(), format!("unknown rope scaling `{kind}`; write `{FORM}`")));
    }
    cursor.expect("(", "after `llama3`")?;
    let factor = scaling_field(cursor, "factor", ",")?;
    let low_freq_factor = scaling_field(cursor, "low", ",")?;
    let high_freq_factor = scaling_field(cursor, "high", ",")?;
    let original_max_position_embeddings = scaling_field(cursor, "original", ")")?;
    if !cursor.at_end() {
        return Err(cursor.expected("end of the scaling after `)`"));
    }
    Ok(RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings })
}

/// `key=number` then `separator`, inside `llama3(..)`.
fn scaling_field<T: std::str::FromStr>(cursor: &mut Cursor<'_>, key: &str, separator: &str) -> Parsed<T> {
    if !cursor.eat_keyword(key) {
        return Err(cursor.expected(&format!("`{key}=` in llama3(factor=..,low=..,high=..,original=..)")));
    }
    cursor.expect("=", &format!("after `{key}`"))?;
    let (text, start) = cursor.list_item();
    let value = text
        .parse()
        .map_err(|_| cursor.error(start, cursor.pos(), format!("expected a number for `{key}`, found `{text}`")))?;
    cursor.expect(separator, &format!("after `{key}={text}`"))?;
    Ok(value)
}

/// Checks the ids across lines and builds the graph: line with value id `i` becomes node `i`.
fn assemble(lines: Vec<NodeLine>, outputs: Vec<(usize, Span)>) -> Parsed<Graph> {
    let count = lines.len();
    let defined = |id: usize, span: Span, what: &str| match count {
        _ if id < count => Ok(()),
        0 => Err(ParseError::at(span, format!("{what} v{id} is not defined; this module has no nodes"))),
        _ => Err(ParseError::at(span, format!("{what} v{id} is not defined; the values are v0 to v{}", count - 1))),
    };
    let mut line_of: Vec<Option<usize>> = vec![None; count];
    for line in &lines {
        if line.value >= count {
            let message = format!(
                "v{} is out of range; the {count} nodes must be numbered v0 to v{}, each once",
                line.value,
                count - 1
            );
            return Err(ParseError::at(line.value_span, message));
        }
        if let Some(first) = line_of[line.value] {
            let message =
                format!("v{} is defined twice (first on line {first}); give each node its own id", line.value);
            return Err(ParseError::at(line.value_span, message));
        }
        line_of[line.value] = Some(line.value_span.line);
    }
    for line in &lines {
        for &(input, span) in &line.inputs {
            defined(input, span, "operand")?;
        }
    }
    for &(output, span) in &outputs {
        defined(output, span, "output")?;
    }
    let order: Vec<NodeId> = lines.iter().filter(|line| !line.detached).map(|line| NodeId::new(line.value)).collect();
    let mut slots: Vec<Option<NodeLine>> = (0..count).map(|_| None).collect();
    for line in lines {
        let id = line.value;
        slots[id] = Some(line);
    }
    // Every slot is filled: `count` lines with distinct ids below `count`.
    let mut nodes = Vec::with_capacity(count);
    let mut values = Vec::with_capacity(count);
    for (id, line) in slots.into_iter().flatten().enumerate() {
        let inputs = line.inputs.iter().map(|&(input, _)| ValueId::new(input)).collect();
        nodes.push(NodeData { op: line.op, inputs, result: ValueId::new(id), name: line.name });
        values.push(ValueData { ty: line.ty, spec: line.spec, def: NodeId::new(id) });
    }
    let outputs = outputs.iter().map(|&(output, _)| ValueId::new(output)).collect();
    Ok(Graph::from_parts(nodes, values, order, outputs))
}
