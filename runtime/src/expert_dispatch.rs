//! Expert parallelism's all-to-all dispatch: rows travel to the ranks that hold their experts and
//! the results travel back.
//!
//! Member `j` of the group holds experts `j·local_experts..(j+1)·local_experts`. Each member routes
//! its own rows with the whole router, tells every other member how many (row, expert) pairs it
//! will send it (an all-to-all of one count a member), sends those rows (an all-to-all with
//! variable counts), runs what it received through its experts as one block an expert, and sends
//! the results back in the order it received the rows (the reverse all-to-all). How many rows move
//! depends on the routing, which is why the counts go first; nothing is dropped (no capacity
//! factor).
//!
//! The backward sends each row's output gradient and routing weight with it. The experts' owners
//! compute their parameter gradients from every row they receive, and return each row's input
//! gradient and the gradient of its routing weight; the rows' owners then add the routing's own
//! gradient (through the softmax and the renormalization) for `x` and the router.

use crate::comm::{CommError, Communicator, Group};
use crate::kernels::{
    expert_backward, expert_forward, route, route_backward, ExpertGrads, ExpertWeights, MoeGradOperand, MoeShape,
    Routing,
};

/// What one dispatch computes.
pub(crate) struct DispatchOperands<'a> {
    /// `x[rows, hidden]`, the rank's own rows.
    pub x: &'a [f32],
    /// `router[experts, hidden]`.
    pub router: &'a [f32],
    /// The experts this rank holds.
    pub weights: ExpertWeights<'a>,
    /// The output's gradient `[rows, hidden]`, for a backward dispatch.
    pub dy: Option<&'a [f32]>,
}

/// One row as it travels to an expert's owner: which of the owner's experts, the row, and in the
/// backward its output gradient and routing weight.
fn row_width(shape: &MoeShape, backward: bool) -> usize {
    if backward {
        2 * shape.hidden + 2
    } else {
        shape.hidden + 1
    }
}

/// Runs the forward (`wrts` empty: returns the mixture's output `[rows, hidden]`, then the rows each
/// of this rank's experts received, one entry an expert) or the backward (returns one gradient a
/// `wrts` entry, each of its operand's local size) over `group`.
pub(crate) fn expert_dispatch(
    comm: &mut dyn Communicator,
    group: &Group,
    shape: &MoeShape,
    operands: &DispatchOperands<'_>,
    wrts: &[MoeGradOperand],
) -> Result<Vec<Vec<f32>>, CommError> {
    let members = group.ranks.len();
    let routing = route(shape, operands.x, operands.router);
    let backward = !wrts.is_empty();
    let dy = operands.dy.filter(|_| backward);
    let (hidden, top_k, local_experts) = (shape.hidden, shape.top_k, shape.local_experts.max(1));
    // The slots each member receives, in slot order.
    let mut slots_to: Vec<Vec<usize>> = vec![Vec::new(); members];
    for (slot, &expert) in routing.chosen.iter().enumerate() {
        slots_to[(expert / local_experts).min(members - 1)].push(slot);
    }
    let width = row_width(shape, backward);
    let mut packed = Vec::with_capacity(routing.chosen.len() * width);
    for (member, slots) in slots_to.iter().enumerate() {
        for &slot in slots {
            let row = slot / top_k;
            packed.push((routing.chosen[slot] - member * local_experts) as f32);
            packed.extend_from_slice(&operands.x[row * hidden..(row + 1) * hidden]);
            if let Some(dy) = dy {
                packed.push(routing.weights[slot]);
                packed.extend_from_slice(&dy[row * hidden..(row + 1) * hidden]);
            }
        }
    }
    let send_rows: Vec<usize> = slots_to.iter().map(Vec::len).collect();
    let recv_rows = exchange_counts(comm, group, &send_rows)?;
    let received = exchange(comm, group, &packed, &send_rows, &recv_rows, width)?;
    let served = serve(shape, operands.weights, &received, width, wrts);
    // The rows' owners need each row's result back unless only the experts' gradients were asked.
    let returns = !backward || wrts.iter().any(|wrt| matches!(wrt, MoeGradOperand::Input | MoeGradOperand::Router));
    let mut results = served.parameter_grads;
    if !returns {
        return Ok(results);
    }
    let back_width = if backward { hidden + 1 } else { hidden };
    let returned = exchange(comm, group, &served.rows, &recv_rows, &send_rows, back_width)?;
    let mut at = 0;
    if !backward {
        let mut out = vec![0.0f32; shape.rows * hidden];
        for &slot in slots_to.iter().flatten() {
            let row = slot / top_k;
            let weight = routing.weights[slot];
            let result = &returned[at..at + hidden];
            out[row * hidden..(row + 1) * hidden]
                .iter_mut()
                .zip(result)
                .for_each(|(total, &value)| *total += weight * value);
            at += hidden;
        }
        let loads = served.loads.iter().map(|&rows| rows as f32).collect();
        return Ok(vec![out, loads]);
    }
    let mut input_grads = vec![0.0f32; shape.rows * hidden];
    let mut weight_grads = vec![0.0f32; routing.chosen.len()];
    for &slot in slots_to.iter().flatten() {
        let row = slot / top_k;
        weight_grads[slot] = returned[at];
        let grad = &returned[at + 1..at + 1 + hidden];
        input_grads[row * hidden..(row + 1) * hidden].iter_mut().zip(grad).for_each(|(total, value)| *total += value);
        at += back_width;
    }
    fill_routing_grads(shape, &routing, &weight_grads, operands, wrts, input_grads, &mut results);
    Ok(results)
}

/// The gradients of `x` and the router (those `wrts` asks for) into their places in `results`.
fn fill_routing_grads(
    shape: &MoeShape,
    routing: &Routing,
    weight_grads: &[f32],
    operands: &DispatchOperands<'_>,
    wrts: &[MoeGradOperand],
    input_grads: Vec<f32>,
    results: &mut [Vec<f32>],
) {
    let mut input_grads = Some(input_grads);
    for (wrt, result) in wrts.iter().zip(results.iter_mut()) {
        match wrt {
            MoeGradOperand::Input => {
                *result = input_grads.take().unwrap_or_else(|| vec![0.0; shape.rows * shape.hidden]);
                route_backward(shape, routing, weight_grads, (operands.x, operands.router), *wrt, result);
            }
            MoeGradOperand::Router => {
                *result = vec![0.0; shape.experts * shape.hidden];
                route_backward(shape, routing, weight_grads, (operands.x, operands.router), *wrt, result);
            }
            MoeGradOperand::Gate | MoeGradOperand::Up | MoeGradOperand::Down => {}
        }
    }
}

/// Every member's count of rows for this one, from this member's counts for each.
fn exchange_counts(comm: &mut dyn Communicator, group: &Group, send_rows: &[usize]) -> Result<Vec<usize>, CommError> {
    // Counts travel as the bits of a u32 in an f32 word, exact whatever their size.
    let counts: Vec<f32> = send_rows.iter().map(|&rows| f32::from_bits(rows as u32)).collect();
    let mut received = vec![0.0f32; counts.len()];
    comm.all_to_all(group, &counts, &mut received)?;
    Ok(received.iter().map(|count| count.to_bits() as usize).collect())
}

/// Sends `send_rows[j]` rows of `width` to member j and receives `recv_rows[i]` from member i.
fn exchange(
    comm: &mut dyn Communicator,
    group: &Group,
    packed: &[f32],
    send_rows: &[usize],
    recv_rows: &[usize],
    width: usize,
) -> Result<Vec<f32>, CommError> {
    let send_counts: Vec<usize> = send_rows.iter().map(|rows| rows * width).collect();
    let recv_counts: Vec<usize> = recv_rows.iter().map(|rows| rows * width).collect();
    let mut received = vec![0.0f32; recv_counts.iter().sum()];
    comm.all_to_all_v(group, (packed, &send_counts), (&mut received, &recv_counts))?;
    Ok(received)
}

/// What a member computes for the rows it received.
struct Served {
    /// One result a received row, in the order received: the expert's output (forward), or the
    /// routing weight's gradient then the input's gradient (backward).
    rows: Vec<f32>,
    /// The experts' parameter gradients asked for, in `wrts` order; empty placeholders for `x` and
    /// the router, which the rows' owners fill.
    parameter_grads: Vec<Vec<f32>>,
    /// The rows each local expert received.
    loads: Vec<usize>,
}

fn serve(
    shape: &MoeShape,
    weights: ExpertWeights<'_>,
    received: &[f32],
    width: usize,
    wrts: &[MoeGradOperand],
) -> Served {
    let hidden = shape.hidden;
    let count = received.len() / width;
    let backward = !wrts.is_empty();
    let expert_size = shape.ffn * hidden;
    let mut parameter_grads: Vec<Vec<f32>> = wrts
        .iter()
        .map(|wrt| match wrt {
            MoeGradOperand::Gate | MoeGradOperand::Up | MoeGradOperand::Down => {
                vec![0.0; shape.local_experts * expert_size]
            }
            MoeGradOperand::Input | MoeGradOperand::Router => Vec::new(),
        })
        .collect();
    let back_width = if backward { hidden + 1 } else { hidden };
    let mut rows = vec![0.0f32; count * back_width];
    let mut loads = vec![0; shape.local_experts];
    for local in 0..shape.local_experts {
        let mine: Vec<usize> = (0..count).filter(|&index| received[index * width] as usize == local).collect();
        loads[local] = mine.len();
        if mine.is_empty() {
            continue;
        }
        let field = |offset: usize, len: usize| -> Vec<f32> {
            mine.iter()
                .flat_map(|&index| received[index * width + offset..index * width + offset + len].to_vec())
                .collect()
        };
        let x = field(1, hidden);
        if !backward {
            let output = expert_forward(shape, local, &x, weights);
            for (result, &index) in output.chunks_exact(hidden).zip(&mine) {
                rows[index * hidden..(index + 1) * hidden].copy_from_slice(result);
            }
            continue;
        }
        let row_weights = field(1 + hidden, 1);
        let dy = field(2 + hidden, hidden);
        let mut grads = ExpertGrads::default();
        for (wrt, grad) in wrts.iter().zip(parameter_grads.iter_mut()) {
            if grad.is_empty() {
                continue;
            }
            let own = &mut grad[local * expert_size..(local + 1) * expert_size];
            match wrt {
                MoeGradOperand::Gate => grads.gate = Some(own),
                MoeGradOperand::Up => grads.up = Some(own),
                MoeGradOperand::Down => grads.down = Some(own),
                MoeGradOperand::Input | MoeGradOperand::Router => {}
            }
        }
        let result = expert_backward(shape, local, (&x, &dy, &row_weights), weights, grads);
        for (position, &index) in mine.iter().enumerate() {
            let row = &mut rows[index * back_width..(index + 1) * back_width];
            row[0] = result.weight_grads[position];
            row[1..].copy_from_slice(&result.input_grads[position * hidden..(position + 1) * hidden]);
        }
    }
    Served { rows, parameter_grads, loads }
}
