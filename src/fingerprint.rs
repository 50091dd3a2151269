//! Plan fingerprints: a stable 64-bit FNV-1a hash of what a plan consists of, printed by `pleat
//! compile` and `pleat plan` so that users (and tests) can see that the same model, mesh and options
//! give the same plan, byte for byte, on every run and machine.
//!
//! FNV-1a is not a cryptographic hash; it only has to change when any byte changes, and to be the
//! same everywhere (no per-process seed, unlike `std`'s hasher).

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// A running FNV-1a hash over byte strings, each framed by its length so that the parts' boundaries
/// count (`"ab" + "c"` differs from `"a" + "bc"`).
pub struct Fingerprint(u64);

impl Fingerprint {
    /// The hash of nothing.
    pub fn new() -> Self {
        Self(OFFSET_BASIS)
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = (self.0 ^ u64::from(byte)).wrapping_mul(PRIME);
        }
    }

    /// Adds one part.
    pub fn part(&mut self, part: &[u8]) -> &mut Self {
        self.bytes(&(part.len() as u64).to_le_bytes());
        self.bytes(part);
        self
    }

    /// The hash as 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_published_fnv1a_vectors() {
        // FNV-1a 64 test vectors (Fowler, Noll, Vo): "" and "a" and "foobar", hashed unframed.
        for (text, expected) in [("", 0xcbf29ce484222325u64), ("a", 0xaf63dc4c8601ec8c), ("foobar", 0x85944171f73967e8)]
        {
            let mut hash = Fingerprint::new();
            hash.bytes(text.as_bytes());
            assert_eq!(hash.0, expected, "{text:?}");
        }
    }

    #[test]
    fn part_boundaries_count() {
        let joined = Fingerprint::new().part(b"ab").part(b"c").hex();
        let split = Fingerprint::new().part(b"a").part(b"bc").hex();
        assert_ne!(joined, split);
        assert_eq!(joined, Fingerprint::new().part(b"ab").part(b"c").hex());
    }
}
