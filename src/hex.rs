//! Lower-case hexadecimal: how the crate writes bytes as text (digests in keys and scopes,
//! `bytea` literals, Redis key tags, JSON `\u` escapes).

/// The digits, by value.
pub(crate) const DIGITS: &[u8; 16] = b"0123456789abcdef";

/// Appends the hex of `bytes` to `out`.
pub(crate) fn push(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for &b in bytes {
        out.push(char::from(DIGITS[usize::from(b >> 4)]));
        out.push(char::from(DIGITS[usize::from(b & 0x0f)]));
    }
}

/// The hex of `bytes`.
pub(crate) fn encode(bytes: &[u8]) -> String {
    let mut s = String::with_capacity(bytes.len() * 2);
    push(&mut s, bytes);
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn encodes_lower_case_two_digits_per_byte() {
        assert_eq!(super::encode(&[0x00, 0xab, 0xff]), "00abff");
        assert_eq!(super::encode(&[]), "");
        let mut s = String::from("x");
        super::push(&mut s, &[0x0f, 0xf0]);
        assert_eq!(s, "x0ff0");
    }
}
