//! A small, seedable generator (xorshift64*) for the random tests: enough randomness for their
//! choices, and each run reproducible from the seed it prints.

/// xorshift64*.
pub struct Rng(u64);

impl Rng {
    /// Seeded with `seed` (0, which would stay 0, is taken as 1).
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}
