//! Where a Hugging Face checkpoint stores a parameter of pleat's graph when not under the graph's
//! own name: a mixture's experts.
//!
//! The graph stacks a layer's experts into one tensor a projection (`[experts, ..]`, named
//! `model.layers.L.block_sparse_moe.experts.w1.weight` for Mixtral,
//! `model.layers.L.mlp.experts.gate_proj.weight` for Qwen2-MoE). Checkpoints store them either
//! - one tensor an expert (`..experts.0.w1.weight`, `..experts.1.w1.weight`, ..), as transformers 4
//!   and the Hub's files do, and transformers 5 writes by default; or
//! - fused, as transformers 5 holds them in memory and writes them with
//!   `save_pretrained(save_original_format=False)`: `model.layers.L.mlp.experts.gate_up_proj`
//!   `[experts, 2·ffn, hidden]` (each expert's gate rows, then its up rows: the forward takes
//!   `chunk(2, dim=-1)` of `x · gate_upᵀ`) and `..mlp.experts.down_proj` `[experts, hidden, ffn]`,
//!   with Mixtral's router renamed from `block_sparse_moe.gate` to `mlp.gate`.

/// How the tensor the graph names is stored, when not under its own name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum StoredAs {
    /// One tensor an expert: expert `E`'s block is `{prefix}.experts.{E}.{projection}`.
    PerExpert {
        /// The layer's block (`model.layers.0.block_sparse_moe`).
        prefix: String,
        /// The projection's name (`w1.weight`).
        projection: String,
    },
    /// The graph's `[experts, ffn, hidden]` gate (`half` 0) or up (`half` 1) projection, as that
    /// half of each expert's rows of `source`, `[experts, 2·ffn, hidden]`.
    FusedHalf {
        /// The fused tensor (`model.layers.0.mlp.experts.gate_up_proj`).
        source: String,
        /// Which half of each expert's rows.
        half: u64,
    },
    /// The same tensor under another name (the fused down projection, Mixtral's renamed router).
    Renamed {
        /// The name in the checkpoint.
        source: String,
    },
}

/// The ways `name` may be stored apart from its own name, in the order a loader tries them; empty
/// when `name` is not a mixture's parameter.
pub(crate) fn stored_as(name: &str) -> Vec<StoredAs> {
    let Some((layer, block, rest)) = split_layer(name) else { return Vec::new() };
    let fused = format!("{layer}.mlp.experts");
    let mut ways = Vec::new();
    if let Some(projection) = rest.strip_prefix("experts.") {
        ways.push(StoredAs::PerExpert { prefix: format!("{layer}.{block}"), projection: projection.to_string() });
        match projection {
            "w1.weight" | "gate_proj.weight" => {
                ways.push(StoredAs::FusedHalf { source: format!("{fused}.gate_up_proj"), half: 0 })
            }
            "w3.weight" | "up_proj.weight" => {
                ways.push(StoredAs::FusedHalf { source: format!("{fused}.gate_up_proj"), half: 1 })
            }
            "w2.weight" | "down_proj.weight" => ways.push(StoredAs::Renamed { source: format!("{fused}.down_proj") }),
            _ => {}
        }
    } else if block == "block_sparse_moe" && rest == "gate.weight" {
        ways.push(StoredAs::Renamed { source: format!("{layer}.mlp.gate.weight") });
    }
    ways
}

/// `model.layers.L.block.rest` as (`model.layers.L`, `block`, `rest`), for the mixture's blocks.
fn split_layer(name: &str) -> Option<(&str, &str, &str)> {
    let after_layers = name.strip_prefix("model.layers.")?;
    let (index, tail) = after_layers.split_once('.')?;
    if index.is_empty() || !index.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    let layer = &name[..name.len() - tail.len() - 1];
    let (block, rest) = tail.split_once('.')?;
    matches!(block, "block_sparse_moe" | "mlp").then_some((layer, block, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mixtral_projection_is_per_expert_or_fused() {
        assert_eq!(
            stored_as("model.layers.3.block_sparse_moe.experts.w3.weight"),
            vec![
                StoredAs::PerExpert {
                    prefix: "model.layers.3.block_sparse_moe".to_string(),
                    projection: "w3.weight".to_string()
                },
                StoredAs::FusedHalf { source: "model.layers.3.mlp.experts.gate_up_proj".to_string(), half: 1 },
            ]
        );
        assert_eq!(
            stored_as("model.layers.0.block_sparse_moe.experts.w2.weight")[1],
            StoredAs::Renamed { source: "model.layers.0.mlp.experts.down_proj".to_string() }
        );
        assert_eq!(
            stored_as("model.layers.12.block_sparse_moe.gate.weight"),
            vec![StoredAs::Renamed { source: "model.layers.12.mlp.gate.weight".to_string() }]
        );
    }

    #[test]
    fn a_qwen2_moe_projection_keeps_its_block() {
        assert_eq!(
            stored_as("model.layers.1.mlp.experts.gate_proj.weight")[1],
            StoredAs::FusedHalf { source: "model.layers.1.mlp.experts.gate_up_proj".to_string(), half: 0 }
        );
        // Qwen2-MoE's router is already `mlp.gate`; its shared expert is never fused.
        assert!(stored_as("model.layers.1.mlp.gate.weight").is_empty());
        assert!(stored_as("model.layers.1.mlp.shared_expert.gate_proj.weight").is_empty());
        assert!(stored_as("model.layers.1.mlp.gate_proj.weight").is_empty());
        assert!(stored_as("model.layers.x.mlp.experts.gate_proj.weight").is_empty());
        assert!(stored_as("model.embed_tokens.weight").is_empty());
    }
}
