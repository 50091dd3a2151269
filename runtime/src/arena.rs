//! A rank's planned arena: one allocation that holds every buffer at the offset the memory planner
//! gave it (`pleat_backend::memory::plan`, each element at its declared size), which the entry path
//! (`crate::capi`) stores its buffers in: generated kernels write their results in place there, and
//! the runtime's results are copied into their slots.
//!
//! Guarantees: a buffer is placed only in the slot planned for it, inside the arena; two buffers
//! live at once never share a byte (checked at every placement, so a planner bug is an error, never
//! aliasing); a buffer the program writes in more than one lifetime has no single slot and stays
//! outside the arena, as does everything when the plan does not fit the address space.

use std::collections::BTreeMap;

use pleat_backend::memory::{plan, ElementSize, ALIGNMENT};
use pleat_backend::{BufferId, Instr, Program};

/// How a placed buffer's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Element {
    F32,
    Bf16,
    U32,
}

impl Element {
    /// Bytes an element.
    pub(crate) fn bytes(self) -> usize {
        match self {
            Element::Bf16 => 2,
            Element::F32 | Element::U32 => 4,
        }
    }
}

/// The arena and which of its byte ranges are taken.
pub(crate) struct Arena {
    /// The allocation, in words so that its start is aligned for every element type.
    words: Vec<u64>,
    /// Each buffer's planned byte offset (`None`: not placed).
    offsets: Vec<Option<usize>>,
    /// The byte ranges held now, start to end.
    taken: BTreeMap<usize, usize>,
}

/// The size of the arena `program`'s memory plan lays out (elements at their declared sizes) and
/// each buffer's byte offset in it: `None` for a buffer never written, or written in more than one
/// lifetime (it has no single slot); `None` overall when the arena does not fit the address space.
pub(crate) fn planned_slots(program: &Program) -> Option<(usize, Vec<Option<usize>>)> {
    let plan = plan(program, ElementSize::Declared);
    let bytes = usize::try_from(plan.arena_bytes).ok()?;
    let mut lifetimes = vec![0u32; program.buffers.len()];
    let mut live = vec![false; program.buffers.len()];
    for instr in &program.instructions {
        match instr {
            Instr::Free { buf } => {
                if let Some(slot) = live.get_mut(buf.as_u32() as usize) {
                    *slot = false;
                }
            }
            _ => {
                for out in instr.outs() {
                    let index = out.as_u32() as usize;
                    if index < live.len() && !live[index] {
                        live[index] = true;
                        lifetimes[index] += 1;
                    }
                }
            }
        }
    }
    let offsets = plan
        .offsets
        .iter()
        .zip(&lifetimes)
        .map(|(offset, &lifetimes)| offset.filter(|_| lifetimes == 1).and_then(|offset| usize::try_from(offset).ok()))
        .collect();
    Some((bytes, offsets))
}

impl Arena {
    /// The arena `program`'s memory plan lays out, zeroed; `None` when it does not fit in memory.
    pub(crate) fn planned(program: &Program) -> Option<Arena> {
        let (bytes, offsets) = planned_slots(program)?;
        debug_assert_eq!(ALIGNMENT % 8, 0, "slots are word-aligned");
        Some(Arena { words: vec![0; bytes.div_ceil(8)], offsets, taken: BTreeMap::new() })
    }

    /// The arena's size in bytes.
    pub(crate) fn bytes(&self) -> usize {
        self.words.len() * 8
    }

    /// Takes buffer `id`'s slot for `len` elements of `element`; its byte offset, or
    /// `None` when the buffer has no slot. An error when the slot lies outside the arena or on bytes
    /// a live buffer holds.
    pub(crate) fn take(&mut self, id: BufferId, element: Element, len: usize) -> Result<Option<usize>, String> {
        let Some(offset) = self.offsets.get(id.as_u32() as usize).copied().flatten() else { return Ok(None) };
        let end = offset + len * element.bytes();
        if end > self.bytes() {
            return Err(format!(
                "{id}'s planned slot {offset}..{end} lies outside the arena of {} bytes",
                self.bytes()
            ));
        }
        // The range starting last at or before `end` is the only one that can overlap from below.
        if let Some((&start, &stop)) = self.taken.range(..end).next_back() {
            if stop > offset {
                return Err(format!(
                    "{id}'s planned slot {offset}..{end} overlaps bytes {start}..{stop} of a live buffer; \
                     this is a pleat bug in the memory planner"
                ));
            }
        }
        self.taken.insert(offset, end);
        Ok(Some(offset))
    }

    /// Gives back the slot at `offset`.
    pub(crate) fn give_back(&mut self, offset: usize) {
        self.taken.remove(&offset);
    }

    /// The `len` elements of type `T` at `offset`.
    ///
    /// # Safety
    /// `offset..offset + len * size_of::<T>()` is a slot [`Arena::take`] returned for a buffer still
    /// live, `T` is f32, u32 or bf16 (every bit pattern valid, alignment at most the slot's).
    pub(crate) unsafe fn slice<T>(&self, offset: usize, len: usize) -> &[T] {
        // SAFETY: the caller passes a taken slot inside the arena; `take` aligned it to `ALIGNMENT`.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().cast::<u8>().add(offset).cast::<T>(), len) }
    }

    /// As [`Arena::slice`], mutable.
    ///
    /// # Safety
    /// As [`Arena::slice`]; no other view of the slot exists (taken slots never overlap).
    pub(crate) unsafe fn slice_mut<T>(&mut self, offset: usize, len: usize) -> &mut [T] {
        // SAFETY: as `slice`, and `&mut self` excludes every other view of the arena.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>().add(offset).cast::<T>(), len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_backend::{Buffer, BufferKind, Kernel, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn program(instructions: Vec<Instr>) -> Program {
        let buffer = |name: &str| Buffer {
            name: name.into(),
            dtype: DType::F32,
            shape: vec![4, 4],
            kind: BufferKind::Activation,
        };
        Program {
            format_version: FORMAT_VERSION,
            model: "test".into(),
            mesh: String::new(),
            rank: 0,
            world_size: 1,
            tokens_shape: vec![],
            buffers: vec![buffer("a"), buffer("b"), buffer("c")],
            instructions,
        }
    }

    fn id(index: usize) -> BufferId {
        BufferId::new(index)
    }

    fn load(out: usize) -> Instr {
        Instr::LoadParam { out: id(out), name: format!("w{out}"), shape: vec![4, 4], region: vec![(0, 4), (0, 4)] }
    }

    fn add(inputs: [usize; 2], out: usize) -> Instr {
        Instr::Kernel { kernel: Kernel::Add, inputs: inputs.iter().map(|&input| id(input)).collect(), out: id(out) }
    }

    #[test]
    fn a_freed_buffers_slot_is_reused_and_a_buffer_of_two_lifetimes_stays_out() {
        // a, b live; c = a + b; free a; a is written again (a second lifetime) from b and c.
        let program = program(vec![load(0), load(1), add([0, 1], 2), Instr::Free { buf: id(0) }, add([1, 2], 0)]);
        let mut arena = Arena::planned(&program).expect("an arena");
        assert_eq!(arena.offsets, vec![None, Some(64), Some(128)], "a has no single slot");
        assert_eq!(arena.take(id(0), Element::F32, 16), Ok(None));
        assert_eq!(arena.take(id(1), Element::F32, 16), Ok(Some(64)));
        assert_eq!(arena.take(id(2), Element::F32, 16), Ok(Some(128)));
        arena.give_back(64);
        assert_eq!(arena.take(id(1), Element::F32, 16), Ok(Some(64)), "a slot given back is free again");
    }

    #[test]
    fn a_slot_on_live_bytes_or_outside_the_arena_is_an_error() {
        let mut arena =
            Arena { words: vec![0; 32], offsets: vec![Some(0), Some(32), Some(200)], taken: BTreeMap::new() };
        assert_eq!(arena.take(id(0), Element::F32, 16), Ok(Some(0)));
        let error = arena.take(id(1), Element::F32, 16).expect_err("32..96 overlaps 0..64");
        assert!(error.contains("overlaps bytes 0..64"), "{error}");
        let error = arena.take(id(2), Element::Bf16, 40).expect_err("200..280 lies past 256");
        assert!(error.contains("outside the arena of 256 bytes"), "{error}");
        arena.give_back(0);
        assert_eq!(arena.take(id(1), Element::F32, 16), Ok(Some(32)));
    }
}
