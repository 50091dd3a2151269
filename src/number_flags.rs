//! Parsers of numeric flags that clap's own do not bound: a float flag must be a finite number
//! in its range (a NaN learning rate would only surface steps later, as a NaN gradient norm).

/// A finite number above 0 (`--lr`, `--mem-cap`).
pub fn positive(text: &str) -> Result<f64, String> {
    let value = finite(text)?;
    if value > 0.0 {
        Ok(value)
    } else {
        Err(format!("{text} is not above 0"))
    }
}

/// A finite number of at least 0 (`--max-grad-norm`, where 0 switches clipping off).
pub fn non_negative(text: &str) -> Result<f64, String> {
    let value = finite(text)?;
    if value >= 0.0 {
        Ok(value)
    } else {
        Err(format!("{text} is below 0"))
    }
}

/// A whole number of at least 1 (`--steps`, `--seq`, `--micro-batches`, ...): clap's own range
/// check answered `0 is not in 1..=4294967295`.
pub fn count<T: std::str::FromStr + PartialEq + From<u8>>(text: &str) -> Result<T, String> {
    let value: T = text.trim().parse().map_err(|_| format!("{text} is not a whole number (1 or more)"))?;
    if value == T::from(0) {
        Err("give 1 or more".to_string())
    } else {
        Ok(value)
    }
}

fn finite(text: &str) -> Result<f64, String> {
    let value: f64 = text.trim().parse().map_err(|_| format!("{text} is not a number"))?;
    if value.is_finite() {
        Ok(value)
    } else {
        Err(format!("{text} is not a finite number"))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn only_finite_numbers_in_range_pass() {
        assert_eq!(super::positive("1e-3"), Ok(1e-3));
        assert_eq!(super::non_negative("0"), Ok(0.0));
        for bad in ["nan", "inf", "-inf", "0", "-1", "x"] {
            assert!(super::positive(bad).is_err(), "{bad}");
        }
        for bad in ["nan", "inf", "-0.5"] {
            assert!(super::non_negative(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn counts_are_whole_numbers_from_one() {
        assert_eq!(super::count::<u32>("7"), Ok(7));
        assert_eq!(super::count::<u64>("0"), Err("give 1 or more".to_string()));
        for bad in ["-1", "1.5", "x", "4294967296"] {
            assert_eq!(super::count::<u32>(bad), Err(format!("{bad} is not a whole number (1 or more)")));
        }
    }
}
