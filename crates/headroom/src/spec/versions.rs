//! `versions:` in a run spec (or a pipeline, or one of its instances): the library versions the
//! run uses. Every key is optional; the estimate follows the versions it models whatever is
//! given, and says so where a given one differs (`estimate::assumptions`).
//!
//! ```yaml
//! versions: {torch: "2.11", transformers: "4.46.3", peft: "0.21", deepspeed: "0.18.2"}
//! ```

use std::fmt;

use serde_json::Value;

use super::parse::unknown_key;
use crate::error::{Error, Result};

/// A release as `major.minor[.patch]`; a local or pre-release suffix (`+cu130`, `rc1`,
/// `.dev0`) is refused rather than guessed at.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Version {
    pub major: u32,
    pub minor: u32,
    pub patch: Option<u32>,
}

impl Version {
    const fn new(major: u32, minor: u32, patch: u32) -> Self {
        Version {
            major,
            minor,
            patch: Some(patch),
        }
    }

    /// Whether `self` names the release `modelled` (a version without a patch names every
    /// patch of its minor release).
    pub fn is(self, modelled: Version) -> bool {
        (self.major, self.minor) == (modelled.major, modelled.minor)
            && self.patch.is_none_or(|p| Some(p) == modelled.patch)
    }

    fn parse(text: &str) -> Option<Self> {
        let number = |s: &str| {
            (!s.is_empty() && s.len() <= 6 && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        let mut parts = text.split('.');
        let major = number(parts.next()?)?;
        let minor = number(parts.next()?)?;
        let patch = match parts.next() {
            None => None,
            Some(p) => Some(number(p)?),
        };
        parts.next().is_none().then_some(Version {
            major,
            minor,
            patch,
        })
    }
}

impl fmt::Display for Version {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if let Some(patch) = self.patch {
            write!(f, ".{patch}")?;
        }
        Ok(())
    }
}

/// A library whose version changes what a run allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Library {
    Torch,
    Transformers,
    Peft,
    Bitsandbytes,
    Deepspeed,
    Trl,
}

impl Library {
    pub const ALL: [Library; 6] = [
        Library::Torch,
        Library::Transformers,
        Library::Peft,
        Library::Bitsandbytes,
        Library::Deepspeed,
        Library::Trl,
    ];

    /// Its key under `versions:` (and its package name).
    pub fn key(self) -> &'static str {
        match self {
            Library::Torch => "torch",
            Library::Transformers => "transformers",
            Library::Peft => "peft",
            Library::Bitsandbytes => "bitsandbytes",
            Library::Deepspeed => "deepspeed",
            Library::Trl => "trl",
        }
    }

    /// Older releases the simulator also translates, where they allocate differently from
    /// [`Library::modelled`] (`sim::model::release` says how; bench/transformers-older and
    /// bench/transformers-4.57 measure each).
    pub fn also_modelled(self) -> &'static [Version] {
        match self {
            Library::Transformers => &[
                TRANSFORMERS_4_46,
                TRANSFORMERS_4_48,
                TRANSFORMERS_4_51,
                TRANSFORMERS_4_53,
                TRANSFORMERS_4_55,
                TRANSFORMERS_4_56,
                TRANSFORMERS_4_57,
            ],
            _ => &[],
        }
    }

    /// The minor releases whose code allocates as the measured release `release` does, as
    /// read in their source (bench/transformers-older/README.md): 4.47 keeps 4.46's attention
    /// classes and loss; 4.49 to 4.52 share 4.51's `sdpa_attention_forward`, loss and
    /// `_update_causal_mask`; 4.54 has 4.55's `sdpa_attention_forward` and masks.
    fn same_code(self, release: Version) -> std::ops::RangeInclusive<u32> {
        match (self, release) {
            (Library::Transformers, TRANSFORMERS_4_46) => 46..=47,
            (Library::Transformers, TRANSFORMERS_4_51) => 49..=52,
            (Library::Transformers, TRANSFORMERS_4_55) => 54..=55,
            _ => release.minor..=release.minor,
        }
    }

    /// The release an estimate follows when a spec gives `given`: the modelled release whose
    /// minor releases hold `given`, else [`Library::modelled`].
    pub fn followed(self, given: Option<Version>) -> Option<Version> {
        let holds = |m: &&Version| {
            given.is_some_and(|g| g.major == m.major && self.same_code(**m).contains(&g.minor))
        };
        self.also_modelled()
            .iter()
            .find(holds)
            .copied()
            .or(self.modelled())
    }

    /// Whether an estimate of a run on `given` follows what that release allocates: `given`
    /// names the release followed, or is one of the minor releases sharing its code.
    pub fn models(self, given: Version) -> bool {
        self.followed(Some(given))
            .is_some_and(|followed| given.is(followed) || self.same_code(followed).count() > 1)
    }

    /// The release the simulator translates, as the measuring machines ran it
    /// (bench/calibration/README.md, bench/distributed/README.md, bench/trainers/README.md).
    pub fn modelled(self) -> Option<Version> {
        match self {
            Library::Torch => Some(Version::new(2, 11, 0)),
            Library::Transformers => Some(Version::new(5, 17, 0)),
            Library::Peft => Some(Version::new(0, 21, 0)),
            Library::Bitsandbytes => Some(Version::new(0, 50, 2)),
            Library::Deepspeed => Some(Version::new(0, 18, 2)),
            Library::Trl => Some(Version::new(1, 16, 0)),
        }
    }
}

/// transformers 4.46.3, measured in bench/transformers-older (4.47 alike).
pub const TRANSFORMERS_4_46: Version = Version::new(4, 46, 3);

/// transformers 4.48.3, measured in bench/transformers-older.
pub const TRANSFORMERS_4_48: Version = Version::new(4, 48, 3);

/// transformers 4.51.3, measured in bench/transformers-older (4.49 to 4.52 alike).
pub const TRANSFORMERS_4_51: Version = Version::new(4, 51, 3);

/// transformers 4.53.3, measured in bench/transformers-older.
pub const TRANSFORMERS_4_53: Version = Version::new(4, 53, 3);

/// transformers 4.55.4, measured in bench/transformers-older (4.54 alike).
pub const TRANSFORMERS_4_55: Version = Version::new(4, 55, 4);

/// transformers 4.56.2, measured in bench/transformers-older.
pub const TRANSFORMERS_4_56: Version = Version::new(4, 56, 2);

/// transformers 4.57.1, measured in bench/transformers-4.57.
pub const TRANSFORMERS_4_57: Version = Version::new(4, 57, 1);

/// The versions a spec gives; `None`: not given (the modelled one is assumed).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Versions {
    given: [Option<Version>; 6],
}

impl Versions {
    /// The version given for `library`, if any.
    pub fn given(&self, library: Library) -> Option<Version> {
        self.given[library as usize]
    }

    /// The release of `library` an estimate of this spec follows.
    pub fn followed(&self, library: Library) -> Option<Version> {
        library.followed(self.given(library))
    }

    /// `self`, with the versions it lacks taken from `outer` (a pipeline's for its instance).
    pub fn or(&self, outer: &Versions) -> Versions {
        let mut given = self.given;
        for (mine, theirs) in given.iter_mut().zip(outer.given) {
            *mine = mine.or(theirs);
        }
        Versions { given }
    }

    /// Read `versions:` (absent or null: nothing given). A version is a string: YAML reads an
    /// unquoted `2.10` as the number 2.1, so numbers are refused rather than misread.
    pub fn from_value(value: Option<&Value>) -> Result<Self> {
        let obj = match value {
            None | Some(Value::Null) => return Ok(Versions::default()),
            Some(Value::Object(obj)) => obj,
            Some(v) => {
                return Err(Error::field(
                    "versions",
                    v,
                    "use a mapping of library versions {torch, transformers, peft, bitsandbytes, \
                     deepspeed, trl}",
                ));
            }
        };
        let keys = Library::ALL.map(Library::key);
        unknown_key(obj, "versions.", &keys, "a library under `versions`")?;
        let mut versions = Versions::default();
        for library in Library::ALL {
            let Some(v) = obj.get(library.key()) else {
                continue;
            };
            let example = library
                .modelled()
                .map_or("0.24.0".to_string(), |m| m.to_string());
            let version = v.as_str().and_then(|s| Version::parse(s.trim()));
            let version = version.ok_or_else(|| {
                let allowed = if v.is_number() {
                    format!(
                        "quote it, as \"{example}\": YAML reads an unquoted 2.10 as the number 2.1"
                    )
                } else {
                    format!(
                        "use a release as major.minor or major.minor.patch, such as \"{example}\""
                    )
                };
                Error::field(format!("versions.{}", library.key()), v, allowed)
            })?;
            versions.given[library as usize] = Some(version);
        }
        Ok(versions)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn read(v: Value) -> Result<Versions> {
        Versions::from_value(Some(&v))
    }

    #[test]
    fn versions_read_as_major_minor_and_an_optional_patch() {
        let v = read(json!({"torch": "2.11", "transformers": "4.46.3", "peft": " 0.21 "})).unwrap();
        assert_eq!(v.given(Library::Torch).unwrap().to_string(), "2.11");
        assert_eq!(
            v.given(Library::Transformers),
            Some(Version {
                major: 4,
                minor: 46,
                patch: Some(3)
            })
        );
        assert_eq!(v.given(Library::Peft).unwrap().to_string(), "0.21");
        assert_eq!(v.given(Library::Deepspeed), None);
        assert_eq!(Versions::from_value(None).unwrap(), Versions::default());
    }

    #[test]
    fn releases_sharing_modelled_code_follow_the_measured_one() {
        let v = |s: &str| Version::parse(s).unwrap();
        let t = Library::Transformers;
        for given in ["4.49", "4.50.3", "4.51.3", "4.52.4"] {
            assert_eq!(
                t.followed(Some(v(given))),
                Some(TRANSFORMERS_4_51),
                "{given}"
            );
            assert!(t.models(v(given)), "{given}");
        }
        assert_eq!(t.followed(Some(v("4.57.0"))), Some(TRANSFORMERS_4_57));
        assert!(!t.models(v("4.57.0")));
        assert!(t.models(v("4.57.1")));
        for given in ["4.46", "4.47.1"] {
            assert_eq!(
                t.followed(Some(v(given))),
                Some(TRANSFORMERS_4_46),
                "{given}"
            );
            assert!(t.models(v(given)), "{given}");
        }
        for given in ["4.54.1", "4.55"] {
            assert_eq!(
                t.followed(Some(v(given))),
                Some(TRANSFORMERS_4_55),
                "{given}"
            );
            assert!(t.models(v(given)), "{given}");
        }
        for (given, followed) in [
            ("4.48", TRANSFORMERS_4_48),
            ("4.53.3", TRANSFORMERS_4_53),
            ("4.56.2", TRANSFORMERS_4_56),
        ] {
            assert_eq!(t.followed(Some(v(given))), Some(followed), "{given}");
            assert!(t.models(v(given)), "{given}");
        }
        // A patch not read follows its minor release's, with a warning.
        for given in ["4.48.0", "4.53.1", "4.56.0"] {
            assert!(!t.models(v(given)), "{given}");
        }
        for given in ["4.45", "4.58"] {
            assert_eq!(t.followed(Some(v(given))), t.modelled(), "{given}");
            assert!(!t.models(v(given)), "{given}");
        }
    }

    #[test]
    fn a_version_names_its_release_or_every_patch_of_it() {
        let modelled = Library::Transformers.modelled().unwrap();
        let v = |s: &str| Version::parse(s).unwrap();
        assert!(v("5.17").is(modelled));
        assert!(v("5.17.0").is(modelled));
        assert!(!v("5.17.1").is(modelled));
        assert!(!v("4.57").is(modelled));
    }

    #[test]
    fn bad_versions_name_the_field_the_value_and_the_form() {
        for (value, shown) in [
            (json!("2.11.0+cu130"), "\"2.11.0+cu130\""),
            (json!("2"), "\"2\""),
            (json!("2.x"), "\"2.x\""),
            (json!("1.2.3.4"), "\"1.2.3.4\""),
            (json!("v2.11"), "\"v2.11\""),
            (json!(true), "true"),
        ] {
            let err = read(json!({"torch": value})).unwrap_err().to_string();
            assert_eq!(
                err,
                format!(
                    "`versions.torch`: {shown} is not allowed; use a release as major.minor or \
                     major.minor.patch, such as \"2.11.0\""
                )
            );
        }
        let err = read(json!({"transformers": 4.46})).unwrap_err().to_string();
        assert_eq!(
            err,
            "`versions.transformers`: 4.46 is not allowed; quote it, as \"5.17.0\": YAML reads \
             an unquoted 2.10 as the number 2.1"
        );
        let err = read(json!({"vllm": "0.11"})).unwrap_err().to_string();
        assert!(
            err.starts_with("`versions.vllm`: this key is not allowed"),
            "{err}"
        );
        assert!(err.contains("torch, transformers, peft, bitsandbytes, deepspeed, trl"));
        let err = read(json!("2.11")).unwrap_err().to_string();
        assert!(
            err.starts_with("`versions`: \"2.11\" is not allowed"),
            "{err}"
        );
    }

    #[test]
    fn an_instance_takes_what_it_lacks_from_its_pipeline() {
        let outer = read(json!({"torch": "2.10", "peft": "0.17"})).unwrap();
        let inner = read(json!({"peft": "0.21"})).unwrap().or(&outer);
        assert_eq!(inner.given(Library::Torch).unwrap().to_string(), "2.10");
        assert_eq!(inner.given(Library::Peft).unwrap().to_string(), "0.21");
    }
}
