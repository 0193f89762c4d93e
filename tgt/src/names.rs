//! Which names the target accepts for bdevs, lvstores, lvols, snapshots, clones and
//! controllers.
//!
//! Everything SPDK accepts that is plain printable ASCII stays accepted (so `ctrlr-<hex>`,
//! UUIDs and the names the CSI driver generates all pass), except `.` and `..`: a controller
//! name is a file name in the socket directory. Refused as well: `/` (lvol aliases are
//! `<lvs>/<lvol>`, so no part may hold one), control characters, and the invisible Unicode
//! characters that make a name display as another one (bidirectional overrides and
//! isolates, zero-width characters, the BOM, soft hyphens, line and paragraph separators,
//! tag characters).

use katablk_rpc::SpdkError;

use crate::error::einval;

/// Longest name, in bytes.
pub const MAX_NAME_LEN: usize = 255;

/// True for characters that render as nothing or reorder the text around them.
fn is_invisible(c: char) -> bool {
    matches!(
        c,
        '\u{00ad}'
            | '\u{034f}'
            | '\u{061c}'
            | '\u{115f}'
            | '\u{1160}'
            | '\u{17b4}'
            | '\u{17b5}'
            | '\u{180b}'..='\u{180f}'
            | '\u{200b}'..='\u{200f}'
            | '\u{2028}'..='\u{202e}'
            | '\u{2060}'..='\u{206f}'
            | '\u{3164}'
            | '\u{fe00}'..='\u{fe0f}'
            | '\u{feff}'
            | '\u{ffa0}'
            | '\u{fff0}'..='\u{fffb}'
            | '\u{1d173}'..='\u{1d17a}'
            | '\u{e0000}'..='\u{e0fff}'
    )
}

/// Checks a new `kind` name (`-22` with the reason if refused).
pub fn valid_name(kind: &str, name: &str) -> Result<(), SpdkError> {
    let why = if name.is_empty() {
        "empty"
    } else if name.len() > MAX_NAME_LEN {
        "longer than 255 bytes"
    } else if name == "." || name == ".." {
        "not a usable file name"
    } else if name.contains('/') {
        "contains '/'"
    } else if name.chars().any(char::is_control) {
        "contains a control character"
    } else if name.chars().any(is_invisible) {
        "contains an invisible or direction-changing Unicode character"
    } else {
        return Ok(());
    };
    Err(einval(format!("bad {kind} name {name:?}: {why}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_what_spdk_and_csi_use() {
        for n in [
            "Malloc0",
            "aio0",
            "Nvme0n1",
            "lvs0",
            "ctrlr-0123456789abcdef",
            "pvc-1f2e3d4c",
            "1805619a-ba2e-4045-a21e-46aa9deccde4",
            "vhost.0",
            "a..b",
            "...",
            "with space",
            "x:y@z_~!#$%^&*()+=[]{}|;'<>,?`\"\\",
            "données",
        ] {
            assert!(valid_name("bdev", n).is_ok(), "{n:?}");
        }
        // Every printable ASCII character but '/'.
        let all: String = (b' '..=b'~')
            .filter(|b| *b != b'/')
            .map(char::from)
            .collect();
        assert!(valid_name("bdev", &all).is_ok());
    }

    #[test]
    fn refuses_confusing_names() {
        for n in [
            "",
            ".",
            "..",
            "a/b",
            "a\nb",
            "a\u{7f}",
            "a\u{85}b",
            "evil\u{202e}gpj.exe",
            "zero\u{200b}width",
            "\u{feff}bom",
            "iso\u{2066}late",
            "soft\u{ad}hyphen",
            "tag\u{e0041}",
        ] {
            let e = valid_name("bdev", n).unwrap_err();
            assert_eq!(e.code, -22, "{n:?}");
            assert!(e.message.contains("bad bdev name"), "{}", e.message);
        }
        assert!(valid_name("bdev", &"x".repeat(256)).is_err());
        assert!(valid_name("bdev", &"x".repeat(255)).is_ok());
    }
}
