//! Reading a fencing token from the values of its header.
//!
//! The grammar is deliberately narrow: exactly one header line whose value is ASCII decimal
//! digits fitting a u64. Anything a lenient parser might "fix" (a sign, hex, inner spaces, a
//! comma list, a second header line) is refused, because two components that read the same
//! header differently are how fences get bypassed.

/// Why a token header was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// No token header at all.
    #[error("no token header")]
    Missing,
    /// The header appears more than once.
    #[error("the token header appears more than once; send exactly one")]
    Repeated,
    /// The header is present but empty.
    #[error("the token header is empty")]
    Empty,
    /// Something other than the digits 0-9 (a sign, hex, spaces, a comma list).
    #[error("the token must be ASCII decimal digits only")]
    NotDecimal,
    /// More than fits in an unsigned 64-bit integer.
    #[error("the token does not fit in 64 bits")]
    Overflow,
}

/// Parses the token from every value its header was sent with: there must be exactly one.
pub fn from_values<'a>(mut values: impl Iterator<Item = &'a [u8]>) -> Result<u64, TokenError> {
    let value = values.next().ok_or(TokenError::Missing)?;
    if values.next().is_some() {
        return Err(TokenError::Repeated);
    }
    parse(value)
}

/// Parses one header value.
pub fn parse(value: &[u8]) -> Result<u64, TokenError> {
    if value.is_empty() {
        return Err(TokenError::Empty);
    }
    if !value.iter().all(u8::is_ascii_digit) {
        return Err(TokenError::NotDecimal);
    }
    value.iter().try_fold(0u64, |acc, &d| {
        acc.checked_mul(10).and_then(|v| v.checked_add(u64::from(d - b'0'))).ok_or(TokenError::Overflow)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn accepts_plain_decimal_including_the_extremes() {
        assert_eq!(parse(b"0"), Ok(0));
        assert_eq!(parse(b"34"), Ok(34));
        assert_eq!(parse(b"0034"), Ok(34));
        assert_eq!(parse(b"18446744073709551615"), Ok(u64::MAX));
    }

    #[test]
    fn refuses_everything_a_lenient_parser_would_fix() {
        assert_eq!(parse(b""), Err(TokenError::Empty));
        assert_eq!(parse(b"18446744073709551616"), Err(TokenError::Overflow));
        assert_eq!(parse(b"99999999999999999999999"), Err(TokenError::Overflow));
        for bad in ["+34", "-1", "0x22", "3 4", " 34", "34,35", "3.4", "34a", "\u{661}"] {
            assert_eq!(parse(bad.as_bytes()), Err(TokenError::NotDecimal), "{bad:?}");
        }
    }

    #[test]
    fn counts_header_lines() {
        let values = |v: &[&'static str]| from_values(v.iter().map(|s| s.as_bytes()).collect::<Vec<_>>().into_iter());
        assert_eq!(values(&[]), Err(TokenError::Missing));
        assert_eq!(values(&["7"]), Ok(7));
        assert_eq!(values(&["7", "7"]), Err(TokenError::Repeated));
    }

    proptest! {
        #[test]
        fn round_trips_every_u64(n: u64) {
            prop_assert_eq!(parse(n.to_string().as_bytes()), Ok(n));
        }

        #[test]
        fn never_panics_and_agrees_with_std_on_digits(s in "[0-9]{1,25}") {
            prop_assert_eq!(parse(s.as_bytes()).ok(), s.parse::<u64>().ok());
        }
    }
}
