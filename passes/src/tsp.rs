//! `fold-tsp`: Tensor-and-Sequence Parallelism (Zyphra) on the `tsp` mesh axis.
//!
//! One axis of degree D splits both the weights (every matrix by heads or ffn, as tensor
//! parallelism does) and the tokens (the sequence, in the zigzag layout that balances causal
//! attention). The pass rewrites each layer of the forward graph:
//! - attention: for each owner j in 0..D, every rank receives owner j's block of Wq, Wk, Wv and Wo
//!   (`broadcast_shard`, which lowering packs into one broadcast), computes q, k, v for owner j's
//!   heads on its own tokens, all-gathers k and v over the sequence, attends with its local queries
//!   against the gathered keys (causal by the zigzag positions), and accumulates the output
//!   projection into its own tokens. No all-reduce: each rank only ever adds to its own tokens.
//! - MLP: one `ring_gated_mlp`, which lowering expands into D steps that compute with the shard a
//!   rank holds while the shard moves on to the next rank (D-1 hops, double-buffered). Training
//!   graphs keep the ring: its gradient (`ring_gated_mlp_grad`) runs the ring again, each shard's
//!   weight gradient travelling with the shard and arriving home complete (docs/training.md).
//! - the embedding stays vocab-parallel over all tokens (every rank holds every token id) and is
//!   reduce-scattered onto the sequence; the LM head all-gathers the sequence first; the logits
//!   are put back in the original token order.
//!
//! The result per layer and rank sends (D-1)/D·(16h² + 2BSh) elements for a gated MLP with
//! ffn = 4h and as many kv heads as heads, against Megatron's (D-1)/D·4BSh.

use pleat_ir::{AxisName, DimName, Graph, Module, Op, ShardSpec, TensorType, ValueId};

use crate::error::{Error, Result};
use crate::manager::{Pass, PassCtx};
use crate::propagate::derive_specs;

/// Rewrites the layers for the `tsp` axis, when the mesh has one, and derives every spec.
pub const FOLD_TSP: Pass = Pass { name: "fold-tsp", run: fold_tsp };

const AXIS: AxisName = AxisName::Tsp;

fn fold_tsp(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    let Some(degree) = module.mesh.axis(AXIS).map(|axis| axis.size) else { return Ok(()) };
    crate::strategy::conflict(&module.mesh, AXIS, AxisName::Tp)?;
    crate::strategy::seed_leaves(module, ctx)?;
    let mut rewriter = Rewriter { graph: &mut module.graph, degree };
    rewriter.fold()?;
    module.graph.compact();
    derive_specs(module, ctx)
}

struct Rewriter<'a> {
    graph: &'a mut Graph,
    degree: u64,
}

fn missing(what: &str) -> Error {
    Error::UnexpectedGraph { pass: FOLD_TSP.name, node: what.to_string() }
}

impl Rewriter<'_> {
    fn find(&self, name: &str) -> Result<ValueId> {
        self.graph.find(name).ok_or_else(|| missing(name))
    }

    /// Inserts `op` after the definition of `after` (a value) and returns its result.
    fn insert(&mut self, after: ValueId, op: Op, inputs: &[ValueId], ty: TensorType, name: &str) -> ValueId {
        let anchor = self.graph.value(after).def;
        let spec = ShardSpec::replicated(ty.shape.rank());
        self.graph.insert_after(anchor, op, inputs, ty, spec, name)
    }

    /// Inserts `op` after `after` and makes every other user of `value` read its result.
    fn wrap(&mut self, value: ValueId, op: Op, name: &str) -> ValueId {
        let ty = self.graph.value(value).ty.clone();
        let wrapped = self.insert(value, op, &[value], ty, name);
        let node = self.graph.value(wrapped).def;
        self.graph.replace_uses(value, wrapped, node);
        wrapped
    }

    fn fold(&mut self) -> Result<()> {
        let (tokens, positions) = (self.find("tokens")?, self.find("positions")?);
        let seq = self.graph.value(tokens).ty.shape.size_of(DimName::Seq).unwrap_or(0);
        if seq % (2 * self.degree) != 0 {
            return Err(Error::ZigzagSeq {
                seq,
                axis: AXIS.to_string(),
                degree: self.degree,
                valid: crate::error::zigzag_valid_degrees(seq),
            });
        }
        let zigzag = Op::Zigzag { parts: self.degree, inverse: false };
        self.wrap(tokens, zigzag.clone(), "tokens.zigzag");
        // The loss compares the logits, put back in token order below, with the tokens in order.
        let loss = self.graph.loss_node();
        if let Some(loss) = loss {
            self.graph.node_mut(loss).inputs[1] = tokens;
        }
        let all_positions = self.wrap(positions, zigzag, "positions.zigzag");
        let ty = self.graph.value(all_positions).ty.clone();
        let local_positions = self.insert(
            all_positions,
            Op::LocalSlice { axis: AXIS, dim: DimName::Seq },
            &[all_positions],
            ty,
            "positions.local",
        );
        let embed = self.find("embed")?;
        self.wrap(embed, Op::ReduceScatter { axis: AXIS, dim: DimName::Seq }, "embed.reduce_scatter");
        let mut layer = 0;
        while self.graph.find(&format!("layer{layer}.attn_norm")).is_some() {
            self.attention(layer, local_positions, all_positions)?;
            // Routed experts stay as they are: each rank routes its own tokens (expert parallelism,
            // when the mesh has `ep`, places the experts). A shared expert (Qwen2-MoE) is a dense
            // MLP and rides the ring.
            if self.graph.find(&format!("layer{layer}.moe")).is_none() {
                self.mlp(layer, "mlp", "down_proj")?;
            } else if self.graph.find(&format!("layer{layer}.shared_expert.down_proj")).is_some() {
                self.mlp(layer, "mlp.shared_expert", "shared_expert.down_proj")?;
            }
            layer += 1;
        }
        let head = self.graph.def(self.find("lm_head")?).clone();
        let normed = head.inputs[0];
        let gathered = self.insert(
            normed,
            Op::AllGather { axis: AXIS, dim: DimName::Seq },
            &[normed],
            self.graph.value(normed).ty.clone(),
            "final_norm.all_gather",
        );
        let head_node = self.graph.value(head.result).def;
        self.graph.node_mut(head_node).inputs[0] = gathered;
        self.wrap(head.result, Op::Zigzag { parts: self.degree, inverse: true }, "logits.unzigzag");
        Ok(())
    }

    fn block(&mut self, weight: ValueId, dim: DimName, owner: u64, name: &str) -> ValueId {
        let mut ty = self.graph.value(weight).ty.clone();
        let position = ty.shape.position(dim).expect("the builder's weights carry this dim");
        ty.shape.0[position].size /= self.degree;
        self.insert(weight, Op::BroadcastShard { axis: AXIS, dim, root: owner }, &[weight], ty, name)
    }

    fn attention(&mut self, layer: u64, local_positions: ValueId, all_positions: ValueId) -> Result<()> {
        let prefix = format!("model.layers.{layer}.self_attn");
        let x = self.find(&format!("layer{layer}.attn_norm"))?;
        let old_output = self.find(&format!("layer{layer}.o_proj"))?;
        let rope = self.graph.def(self.find(&format!("layer{layer}.q_rope"))?).op.clone();
        let weight = |proj: &str| format!("{prefix}.{proj}.weight");
        let (wq, wk, wv, wo) = (
            self.find(&weight("q_proj"))?,
            self.find(&weight("k_proj"))?,
            self.find(&weight("v_proj"))?,
            self.find(&weight("o_proj"))?,
        );
        let bias = |proj: &str| self.graph.find(&format!("{prefix}.{proj}.bias"));
        let biases = [bias("q_proj"), bias("k_proj"), bias("v_proj")];
        let dtype = self.graph.value(x).ty.dtype;
        let x_shape = self.graph.value(x).ty.shape.clone();
        let mut sum: Option<ValueId> = None;
        // Every new node goes after the old output projection, where all its inputs exist.
        let mut at = old_output;
        for owner in 0..self.degree {
            let name = |part: &str| format!("layer{layer}.attn.owner{owner}.{part}");
            let mut heads = Vec::new();
            for (index, (proj_weight, dim)) in
                [(wq, DimName::Heads), (wk, DimName::KvHeads), (wv, DimName::KvHeads)].into_iter().enumerate()
            {
                let block = self.block(proj_weight, dim, owner, &name(["wq", "wk", "wv"][index]));
                self.move_after(block, &mut at);
                let block_bias = biases[index].map(|bias| {
                    let block = self.block(bias, dim, owner, &name(["bq", "bk", "bv"][index]));
                    self.move_after(block, &mut at);
                    block
                });
                heads.push((block, block_bias));
            }
            let wo_block = self.block(wo, DimName::Heads, owner, &name("wo"));
            self.move_after(wo_block, &mut at);
            let mut projected = Vec::new();
            for (index, (block, block_bias)) in heads.into_iter().enumerate() {
                let weight_shape = self.graph.value(block).ty.shape.clone();
                let dims = [x_shape.dims()[0], x_shape.dims()[1], weight_shape.dims()[0], weight_shape.dims()[1]];
                let ty = TensorType { dtype, shape: pleat_ir::Shape(dims.to_vec()) };
                let mut value =
                    self.insert(at, Op::MatMul { contract: 1 }, &[x, block], ty.clone(), &name(["q", "k", "v"][index]));
                at = value;
                if let Some(block_bias) = block_bias {
                    value = self.insert(
                        at,
                        Op::Add,
                        &[value, block_bias],
                        ty.clone(),
                        &name(["q_bias", "k_bias", "v_bias"][index]),
                    );
                    at = value;
                }
                if index < 2 {
                    value = self.insert(
                        at,
                        rope.clone(),
                        &[value, local_positions],
                        ty,
                        &name(["q_rope", "k_rope"][index]),
                    );
                    at = value;
                }
                projected.push(value);
            }
            let mut gathered = Vec::new();
            for (index, &value) in projected[1..].iter().enumerate() {
                let ty = self.graph.value(value).ty.clone();
                let all = self.insert(
                    at,
                    Op::AllGather { axis: AXIS, dim: DimName::Seq },
                    &[value],
                    ty,
                    &name(["k_all", "v_all"][index]),
                );
                at = all;
                gathered.push(all);
            }
            let q_ty = self.graph.value(projected[0]).ty.clone();
            let attended = self.insert(
                at,
                Op::Attention { causal: true },
                &[projected[0], gathered[0], gathered[1], local_positions, all_positions],
                q_ty,
                &name("attention"),
            );
            at = attended;
            let out_ty = self.graph.value(x).ty.clone();
            let output =
                self.insert(at, Op::MatMul { contract: 2 }, &[attended, wo_block], out_ty.clone(), &name("o_proj"));
            at = output;
            self.add_to_sum(&mut sum, output, &mut at, out_ty, &name("o_sum"));
        }
        let total = sum.expect("a mesh axis has at least one rank");
        let total_node = self.graph.value(total).def;
        self.graph.replace_uses(old_output, total, total_node);
        Ok(())
    }

    /// Adds one owner's `output` to the running `sum` of the owners' outputs, just after `at`.
    fn add_to_sum(&mut self, sum: &mut Option<ValueId>, output: ValueId, at: &mut ValueId, ty: TensorType, name: &str) {
        *sum = Some(match *sum {
            None => output,
            Some(previous) => {
                let total = self.insert(*at, Op::Add, &[previous, output], ty, name);
                *at = total;
                total
            }
        });
    }

    /// `block` was inserted right after its weight; move it to just after `at` so each owner's
    /// blocks sit together (lowering packs adjacent broadcasts from one owner into one message).
    fn move_after(&mut self, block: ValueId, at: &mut ValueId) {
        let node = self.graph.value(block).def;
        let anchor = self.graph.value(*at).def;
        self.graph.move_after(node, anchor);
        *at = block;
    }

    /// Replaces the gated MLP whose weights are under `model.layers.{layer}.{block}` and whose
    /// output is node `layer{layer}.{output}` with one ring.
    fn mlp(&mut self, layer: u64, block: &str, output: &str) -> Result<()> {
        let prefix = format!("model.layers.{layer}.{block}");
        let x = self.find(&format!("layer{layer}.mlp_norm"))?;
        let old_output = self.find(&format!("layer{layer}.{output}"))?;
        let weights = [
            self.find(&format!("{prefix}.gate_proj.weight"))?,
            self.find(&format!("{prefix}.up_proj.weight"))?,
            self.find(&format!("{prefix}.down_proj.weight"))?,
        ];
        let ty = self.graph.value(old_output).ty.clone();
        let ring = self.insert(
            old_output,
            Op::RingGatedMlp { axis: AXIS },
            &[x, weights[0], weights[1], weights[2]],
            ty,
            &format!("layer{layer}.mlp_ring"),
        );
        let ring_node = self.graph.value(ring).def;
        self.graph.replace_uses(old_output, ring, ring_node);
        Ok(())
    }
}
