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
}
