//! What the chart binaries share: the font they render text with, and error mapping.

use anyhow::{bail, Context, Result};
use plotters::style::FontStyle;
use std::path::{Path, PathBuf};

/// Where Debian and other distributions keep DejaVu Sans.
pub const FONT_CANDIDATES: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

/// The family name charts use for all text (registered by [`load_font`]).
pub const FONT: &str = "sans-serif";

/// Registers the TrueType font at `explicit` (else the first of [`FONT_CANDIDATES`]) as
/// [`FONT`], for plotters' `ab_glyph` backend.
pub fn load_font(explicit: Option<&Path>) -> Result<()> {
    let path = match explicit {
        Some(p) => p.to_path_buf(),
        None => match FONT_CANDIDATES.iter().map(PathBuf::from).find(|p| p.is_file()) {
            Some(p) => p,
            None => bail!(
                "no font found (looked for {}); install one with 'apt-get install fonts-dejavu-core' \
                 or pass --font FILE.ttf",
                FONT_CANDIDATES.join(", ")
            ),
        },
    };
    let bytes = std::fs::read(&path).with_context(|| format!("reading font {}", path.display()))?;
    // plotters keeps fonts for the life of the program.
    let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
    plotters::style::register_font(FONT, FontStyle::Normal, bytes)
        .map_err(|_| anyhow::anyhow!("{} is not a usable TrueType/OpenType font", path.display()))
}

/// A drawing error as an `anyhow` error.
pub fn plot_err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow::anyhow!("drawing chart: {e}")
}
