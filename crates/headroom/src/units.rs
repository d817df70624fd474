//! Byte sizes as people read and write them, in one place so that every table, verdict and
//! remedy prints a size the same way.
//!
//! Two spellings coexist on purpose:
//! - [`gib`] and [`signed_gib`]: headroom's own, always GiB with two decimals, so that the
//!   numbers of one table line up and compare at a glance;
//! - [`format_size`] and [`parse_size_prefix`]: PyTorch's `format_size` (bytes, KiB, MiB or
//!   GiB by magnitude), which its out-of-memory messages and snapshot tools print; headroom
//!   reads those messages and reports snapshots in the unit their users already saw.
//!
//! [`parse_size`] reads the sizes users type (`--gpu 64GiB`).

pub use headroom_alloc::format_size;

/// Bytes in a mebibyte.
pub const MIB: u64 = 1 << 20;
/// Bytes in a gibibyte.
pub const GIB: u64 = 1 << 30;

/// Bytes as GiB with two decimals: `12.34 GiB`.
pub fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / GIB as f64)
}

/// A difference of bytes as GiB with its sign: `+1.50 GiB`, `-0.25 GiB`.
pub fn signed_gib(bytes: i128) -> String {
    format!("{:+.2} GiB", bytes as f64 / GIB as f64)
}

/// A size given in GiB, in bytes (truncated): the catalog writes capacities as PyTorch
/// prints them.
pub const fn from_gib(gib: f64) -> u64 {
    (gib * GIB as f64) as u64
}

/// A size as users type it: `64GiB`, `64 GB`, `80g`, `512MiB`; binary or decimal units.
/// `None` for anything else, zero and negative sizes included.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim().to_ascii_lowercase();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.'))?;
    let (num, unit) = t.split_at(split);
    let value: f64 = num.parse().ok()?;
    let factor = match unit.trim() {
        "gib" | "g" => GIB as f64,
        "gb" => 1e9,
        "mib" => MIB as f64,
        "mb" => 1e6,
        _ => return None,
    };
    (value > 0.0).then_some((value * factor) as u64)
}

/// A size at the start of `s`, as an out-of-memory message prints it ([`format_size`]:
/// `N bytes` or `X.YY KiB|MiB|GiB|TiB`, any number of decimals) or as people retype it
/// (`2.00GB`, `156 mb`, `0 B`: any case, the space optional, and `KB`/`MB`/`GB`/`TB` read as the
/// binary units PyTorch printed): the bytes and the length read. The bytes round half up, as
/// the printed value is itself rounded, and saturate: NVML's "not available" prints as
/// 17179869184.00 GiB, one past `u64::MAX`.
pub fn parse_size_prefix(s: &str) -> Option<(u64, usize)> {
    let int_len = s.bytes().take_while(u8::is_ascii_digit).count();
    if int_len == 0 {
        return None;
    }
    let mut len = int_len;
    let mut frac = "";
    if s[len..].starts_with('.') {
        let frac_len = s[len + 1..].bytes().take_while(u8::is_ascii_digit).count();
        if frac_len > 0 {
            frac = &s[len + 1..len + 1 + frac_len];
            len += 1 + frac_len;
        }
    }
    let (unit, unit_len) = printed_unit(&s[len..]).or_else(|| retyped_unit(&s[len..]))?;
    let digits: String = [&s[..int_len], frac].concat();
    let numerator: u128 = digits.parse().ok()?;
    let denominator = 10u128.checked_pow(u32::try_from(frac.len()).ok()?)?;
    let bytes = numerator
        .checked_mul(unit)?
        .checked_mul(2)?
        .checked_add(denominator)?
        / (2 * denominator);
    Some((u64::try_from(bytes).unwrap_or(u64::MAX), len + unit_len))
}

/// A unit as `format_size` prints it, after its one space: the factor and the length read.
fn printed_unit(s: &str) -> Option<(u128, usize)> {
    let name = s.strip_prefix(' ')?;
    [
        ("bytes", 1u128),
        ("KiB", 1 << 10),
        ("MiB", 1 << 20),
        ("GiB", 1 << 30),
        ("TiB", 1 << 40),
    ]
    .iter()
    .find(|(unit, _)| name.starts_with(unit))
    .map(|&(unit, factor)| (factor, 1 + unit.len()))
}

/// A retyped unit: an optional space, then a whole word naming a unit in any case.
fn retyped_unit(s: &str) -> Option<(u128, usize)> {
    let space = usize::from(s.starts_with(' '));
    let word_len = s[space..]
        .bytes()
        .take_while(u8::is_ascii_alphabetic)
        .count();
    let factor = match s[space..space + word_len].to_ascii_lowercase().as_str() {
        "b" | "byte" | "bytes" => 1,
        "kb" | "kib" => 1 << 10,
        "mb" | "mib" => 1 << 20,
        "gb" | "gib" => 1 << 30,
        "tb" | "tib" => 1 << 40,
        _ => return None,
    };
    Some((factor, space + word_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gib_keeps_two_decimals_and_the_sign_when_asked() {
        assert_eq!(gib(0), "0.00 GiB");
        assert_eq!(gib(3 << 29), "1.50 GiB");
        assert_eq!(signed_gib(3 << 29), "+1.50 GiB");
        assert_eq!(signed_gib(-(1 << 28)), "-0.25 GiB");
    }

    #[test]
    fn typed_sizes_take_binary_and_decimal_units() {
        assert_eq!(parse_size("64GiB"), Some(64 << 30));
        assert_eq!(parse_size(" 80g "), Some(80 << 30));
        assert_eq!(parse_size("64 GB"), Some(64_000_000_000));
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("0GiB"), None);
        assert_eq!(parse_size("64"), None);
        assert_eq!(parse_size("64 TB"), None);
        assert_eq!(from_gib(79.25), 85_094_039_552);
    }

    #[test]
    fn sizes_round_like_format_size_prints_them() {
        assert_eq!(parse_size_prefix("0 bytes"), Some((0, 7)));
        assert_eq!(parse_size_prefix("512 bytes."), Some((512, 9)));
        assert_eq!(parse_size_prefix("2.00 MiB"), Some((2 << 20, 8)));
        // 79.25 GiB = 7925/100 × 2^30, exactly.
        assert_eq!(
            parse_size_prefix("79.25 GiB").map(|p| p.0),
            Some(85_094_039_552)
        );
        // 1.55 MiB = 1625292.8 bytes → rounds to 1625293.
        assert_eq!(parse_size_prefix("1.55 MiB").map(|p| p.0), Some(1_625_293));
        // NVML_VALUE_NOT_AVAILABLE printed by format_size: 2^64 bytes, saturated.
        assert_eq!(
            parse_size_prefix("17179869184.00 GiB").map(|p| p.0),
            Some(u64::MAX)
        );
        assert_eq!(parse_size_prefix("GiB"), None);
        // Sizes too large for any arithmetic are not sizes, and never overflow.
        assert_eq!(
            parse_size_prefix("200000000000000000000000000000000000000 bytes"),
            None
        );
    }

    #[test]
    fn retyped_sizes_read_as_the_binary_units_pytorch_printed() {
        assert_eq!(parse_size_prefix("12.5 GB"), Some((12 << 30 | 1 << 29, 7)));
        assert_eq!(parse_size_prefix("156.00MiB,"), Some((156 << 20, 9)));
        assert_eq!(parse_size_prefix("2 mb"), Some((2 << 20, 4)));
        assert_eq!(parse_size_prefix("512 KB)"), Some((512 << 10, 6)));
        assert_eq!(parse_size_prefix("0 B."), Some((0, 3)));
        assert_eq!(parse_size_prefix("3 Bytes"), Some((3, 7)));
        assert_eq!(parse_size_prefix("1 TB"), Some((1 << 40, 4)));
        // A word that merely starts like a unit is not one.
        assert_eq!(parse_size_prefix("2 GBs"), None);
        assert_eq!(parse_size_prefix("4 blocks"), None);
    }

    #[test]
    fn what_format_size_prints_reads_back() {
        for bytes in [0, 1024, 1 << 20, 22 << 20, 3 << 30] {
            let text = format_size(bytes);
            assert_eq!(parse_size_prefix(&text), Some((bytes, text.len())));
        }
    }
}
