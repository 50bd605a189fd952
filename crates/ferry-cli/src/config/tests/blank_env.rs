//! A blank `FERRY_*__*` variable sets nothing: it is refused, naming the
//! variable and the fix, instead of replacing the file's value with an
//! empty one (for `secrets`, no secret at all: every webhook unsigned).

use super::*;

const SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";
const OTHER_SECRET: &str = "whsec_c2VjcmV0LWtleS1udW1iZXItdHdvISE=";

/// A file with a signed webhook sink that sends a header.
fn webhook_file(dir: &tempfile::TempDir) -> std::path::PathBuf {
    let path = dir.path().join("ferry.toml");
    std::fs::write(
        &path,
        format!(
            "{MINIMAL}[sinks.Hooks]\nkind = \"webhook\"\nsecrets = [\"{SECRET}\"]\n\
             headers = {{ Authorization = \"Bearer file\" }}\n\
             [[routes]]\nmatch = \"user.*\"\nsink = \"Hooks\"\ndestination = \"http://h/in\"\n"
        ),
    )
    .unwrap();
    path
}

fn refused(path: &Path, name: &str, value: &str) -> String {
    match load_with_env(Some(path), env(&[(name, value)])) {
        Ok(c) => panic!("{name}={value:?} was accepted: {:?}", c.sinks),
        Err(e) => e.to_string(),
    }
}

#[test]
fn blank_secrets_from_the_environment_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = webhook_file(&dir);
    let name = "FERRY_SINKS__HOOKS__SECRETS";
    for blank in ["", "  ", ",", " , ", ",,"] {
        let e = refused(&path, name, blank);
        assert!(e.starts_with(&format!("{name}: ")), "{blank:?}: {e}");
        assert!(
            e.contains("unset the variable to keep the config file's value (or the default), or give it a value"),
            "{blank:?}: {e}"
        );
        assert!(e.contains("sinks.hooks.secrets"), "{blank:?}: {e}");
    }
    // A blank item among secrets: one of them expanded to nothing.
    for value in [format!("{SECRET},"), format!("{SECRET}, ,{OTHER_SECRET}")] {
        let e = refused(&path, name, &value);
        assert!(e.starts_with(&format!("{name}: item 2 of ")), "{e}");
        assert!(e.contains("remove the comma or give the secret"), "{e}");
        assert!(!e.contains(SECRET), "{e}");
    }
    // The file refuses an empty secret, too.
    let e = errors_with(
        "[sinks.hooks]\nkind = \"webhook\"\nsecrets = [\"\"]\n[[routes]]\nmatch = \"a.*\"\nsink = \"hooks\"\n\
         destination = \"http://h/in\"\n",
    );
    assert!(e.starts_with("sinks.hooks.secrets[0]"), "{e}");
    // Set, the variable replaces the file's list.
    let c = load_with_env(Some(&path), env(&[(name, &format!(" {OTHER_SECRET} , {SECRET}"))])).unwrap();
    assert!(matches!(&c.sinks["Hooks"], SinkSpec::Webhook(w) if w.secrets == [OTHER_SECRET, SECRET]));
}

/// Every other field: a header's value, a Kafka property, a URL. None
/// takes a blank value from the environment.
#[test]
fn blank_values_of_any_field_from_the_environment_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = webhook_file(&dir);
    for (name, field) in [
        (
            "FERRY_SINKS__HOOKS__HEADERS__AUTHORIZATION",
            "sinks.hooks.headers.authorization",
        ),
        ("FERRY_SINKS__HOOKS__HEADERS__X_TENANT", "sinks.hooks.headers.x_tenant"),
        (
            "FERRY_SINKS__KAFKA__EXTRA__SASL_PASSWORD",
            "sinks.kafka.extra.sasl_password",
        ),
        ("FERRY_DATABASE__URL", "database.url"),
        ("FERRY_RETENTION__ARCHIVE_DIR", "retention.archive_dir"),
    ] {
        for blank in ["", " \t"] {
            let e = refused(&path, name, blank);
            assert_eq!(
                e,
                format!(
                    "{name}: is empty, which would set {field} to nothing; unset the variable to keep the \
                     config file's value (or the default), or give it a value"
                ),
            );
        }
    }
    let c = load_with_env(
        Some(&path),
        env(&[("FERRY_SINKS__HOOKS__HEADERS__AUTHORIZATION", "Bearer env")]),
    )
    .unwrap();
    assert!(
        matches!(&c.sinks["Hooks"], SinkSpec::Webhook(w) if w.headers.values().any(|v| v == "Bearer env")),
        "{:?}",
        c.sinks
    );
}
