//! Replays the fuzz corpus (`fuzz/corpus/`) through the same property checks the `cargo fuzz`
//! targets run, on the stable toolchain, so every input a fuzzer ever kept stays a test.

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) -> usize {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus").join(target);
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let path = entry.unwrap().path();
        let data = std::fs::read(&path).unwrap();
        let outcome = std::panic::catch_unwind(|| check(&data));
        assert!(outcome.is_ok(), "{} fails its check", path.display());
        n += 1;
    }
    assert!(n > 0, "no corpus for {target}");
    n
}

#[test]
fn token_corpus_keeps_its_properties() {
    replay("token", fencegate::fuzzing::token);
}

#[test]
fn path_corpus_keeps_its_properties() {
    replay("path", fencegate::fuzzing::path);
}

#[test]
fn config_corpus_keeps_its_properties() {
    replay("config", fencegate::fuzzing::config);
}

#[test]
fn recovery_corpus_and_seeds_keep_their_properties() {
    for seed in fencegate::fuzzing::recovery_seeds() {
        fencegate::fuzzing::recovery(&seed);
    }
    replay("recovery", fencegate::fuzzing::recovery);
}

/// Writes the generated recovery seeds into the corpus: `cargo test --test meta --
/// --ignored fuzz_corpus::write_recovery_seeds`.
#[test]
#[ignore]
fn write_recovery_seeds() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/recovery");
    std::fs::create_dir_all(&dir).unwrap();
    for (i, seed) in fencegate::fuzzing::recovery_seeds().iter().enumerate() {
        std::fs::write(dir.join(format!("seed-{i}")), seed).unwrap();
    }
}
