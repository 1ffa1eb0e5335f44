//! What a step records: [`PhaseState`].

use bytes::Bytes;

/// A value a step records as its state, to be given back when a retry resumes after it.
///
/// Implemented for `()`, byte and text buffers, integers, `bool` and pairs of them. For a
/// struct, record what the later phases need to find the rest (an ID), or encode it yourself
/// into `Vec<u8>` (with serde, say).
pub trait PhaseState: Sized {
    /// The state's bytes.
    fn to_state(&self) -> Vec<u8>;
    /// The value back from its bytes; `None` when they are not one.
    fn from_state(state: &[u8]) -> Option<Self>;
}

impl PhaseState for () {
    fn to_state(&self) -> Vec<u8> {
        Vec::new()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        state.is_empty().then_some(())
    }
}

impl PhaseState for Vec<u8> {
    fn to_state(&self) -> Vec<u8> {
        self.clone()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        Some(state.to_vec())
    }
}

impl PhaseState for Bytes {
    fn to_state(&self) -> Vec<u8> {
        self.to_vec()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        Some(Bytes::copy_from_slice(state))
    }
}

impl PhaseState for String {
    fn to_state(&self) -> Vec<u8> {
        self.as_bytes().to_vec()
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        String::from_utf8(state.to_vec()).ok()
    }
}

impl PhaseState for bool {
    fn to_state(&self) -> Vec<u8> {
        vec![u8::from(*self)]
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        match state {
            [0] => Some(false),
            [1] => Some(true),
            _ => None,
        }
    }
}

macro_rules! int_state {
    ($($t:ty),*) => {$(
        impl PhaseState for $t {
            fn to_state(&self) -> Vec<u8> {
                self.to_be_bytes().to_vec()
            }
            fn from_state(state: &[u8]) -> Option<Self> {
                state.try_into().ok().map(<$t>::from_be_bytes)
            }
        }
    )*};
}
int_state!(i32, i64, u32, u64, i128, u128);

impl<A: PhaseState, B: PhaseState> PhaseState for (A, B) {
    fn to_state(&self) -> Vec<u8> {
        let a = self.0.to_state();
        let b = self.1.to_state();
        // A state longer than u32::MAX cannot be recorded anyway (the bound is 64 KiB): the
        // length saturates, and decoding such a pair fails.
        let len = u32::try_from(a.len()).unwrap_or(u32::MAX);
        let mut out = Vec::with_capacity(4 + a.len() + b.len());
        out.extend_from_slice(&len.to_be_bytes());
        out.extend_from_slice(&a);
        out.extend_from_slice(&b);
        out
    }
    fn from_state(state: &[u8]) -> Option<Self> {
        let (len, rest) = state.split_first_chunk::<4>()?;
        let len = usize::try_from(u32::from_be_bytes(*len)).ok()?;
        let (a, b) = rest.split_at_checked(len)?;
        Some((A::from_state(a)?, B::from_state(b)?))
    }
}
