//! Sets of subjects, compared exactly: a subject filter (`*` one token, `>`
//! one or more at the end) or a subject template's shape (a placeholder
//! that may fill several tokens may stand anywhere, with fixed tokens after
//! it). `check` uses them to tell which of a route's subjects a stream
//! captures and its consumers want.
//!
//! Each shape is a small automaton over tokens; two subjects that differ
//! only in tokens no shape names literally are alike to every shape, so
//! trying each named token and one other is trying every subject.

use std::collections::{BTreeSet, HashSet, VecDeque};

use super::message::placeholders_in;

/// One step of a [`Shape`].
#[derive(Debug, Clone, PartialEq, Eq)]
enum Part {
    /// This token.
    Lit(String),
    /// Any one token.
    One,
    /// Any number of tokens, none included.
    Any,
}

/// A set of subjects.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shape(Vec<Part>);

impl Shape {
    /// The subjects a filter (or a plain subject) matches.
    pub(crate) fn filter(filter: &str) -> Self {
        let mut parts = Vec::new();
        for token in filter.split('.') {
            match token {
                "*" => parts.push(Part::One),
                ">" => parts.extend([Part::One, Part::Any]),
                _ => parts.push(Part::Lit(token.to_owned())),
            }
        }
        Self(parts)
    }

    /// The subjects `template` may render (and maybe a few more): a token
    /// without a placeholder is itself; one holding only `{domain}` or
    /// `{id}` is one token, whatever the event; one holding `{type}` (two
    /// segments or more) two tokens or more, and one holding `{key}` (which
    /// may have dots in it) one or more. The fixed tokens after those still
    /// end every subject: `orders.{key}.v1` never renders `orders.a.v2`.
    pub(crate) fn template(template: &str) -> Self {
        let mut parts = Vec::new();
        for token in template.split('.') {
            let held = placeholders_in(token);
            if held.is_empty() {
                parts.push(Part::Lit(token.to_owned()));
            } else if held.contains(&"{type}") {
                parts.extend([Part::One, Part::One, Part::Any]);
            } else if held.contains(&"{key}") {
                parts.extend([Part::One, Part::Any]);
            } else {
                parts.push(Part::One);
            }
        }
        Self(parts)
    }
}

/// Where each of a union of shapes may be, having read some tokens: the
/// shape's index, and how many of its parts are behind.
type State = BTreeSet<(usize, usize)>;

/// Adds to `state` what skipping an [`Part::Any`] reaches.
fn closed(shapes: &[Shape], mut state: State) -> State {
    let mut todo: Vec<(usize, usize)> = state.iter().copied().collect();
    while let Some((k, p)) = todo.pop() {
        if shapes[k].0.get(p) == Some(&Part::Any) && state.insert((k, p + 1)) {
            todo.push((k, p + 1));
        }
    }
    state
}

fn start(shapes: &[Shape]) -> State {
    closed(shapes, (0..shapes.len()).map(|k| (k, 0)).collect())
}

/// `state` having read `token` (`None`: a token no shape names).
fn step(shapes: &[Shape], state: &State, token: Option<&str>) -> State {
    let mut next = State::new();
    for &(k, p) in state {
        match shapes[k].0.get(p) {
            Some(Part::Lit(lit)) if Some(lit.as_str()) == token => {
                next.insert((k, p + 1));
            }
            Some(Part::One) => {
                next.insert((k, p + 1));
            }
            Some(Part::Any) => {
                next.insert((k, p));
            }
            _ => {}
        }
    }
    closed(shapes, next)
}

fn accepts(shapes: &[Shape], state: &State) -> bool {
    state.iter().any(|&(k, p)| p == shapes[k].0.len())
}

/// Whether some subject is in every union of `inside` and in none of
/// `outside`'s shapes.
fn exists(inside: &[&[Shape]], outside: &[Shape]) -> bool {
    let all: Vec<&[Shape]> = inside.iter().copied().chain([outside]).collect();
    let mut alphabet: Vec<Option<&str>> = all
        .iter()
        .flat_map(|shapes| shapes.iter())
        .flat_map(|shape| shape.0.iter())
        .filter_map(|part| match part {
            Part::Lit(lit) => Some(Some(lit.as_str())),
            _ => None,
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    alphabet.push(None);
    let first: Vec<State> = all.iter().map(|shapes| start(shapes)).collect();
    let mut seen = HashSet::from([first.clone()]);
    let mut todo = VecDeque::from([first]);
    while let Some(states) = todo.pop_front() {
        for token in &alphabet {
            let next: Vec<State> = all
                .iter()
                .zip(&states)
                .map(|(shapes, state)| step(shapes, state, *token))
                .collect();
            let (ins, out) = next.split_at(inside.len());
            // No subject starting so is in every union of `inside`.
            if ins.iter().any(State::is_empty) {
                continue;
            }
            if ins.iter().zip(inside).all(|(state, shapes)| accepts(shapes, state)) && !accepts(outside, &out[0]) {
                return true;
            }
            if seen.insert(next.clone()) {
                todo.push_back(next);
            }
        }
    }
    false
}

/// Whether some subject is in each of the unions `sets`.
pub(crate) fn meet(sets: &[&[Shape]]) -> bool {
    exists(sets, &[])
}

/// Whether every subject in all of the unions `inside` is in `by` (in one
/// of its shapes or another).
pub(crate) fn covered(inside: &[&[Shape]], by: &[Shape]) -> bool {
    !exists(inside, by)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn overlap(a: &str, b: &str) -> bool {
        meet(&[&[Shape::filter(a)], &[Shape::filter(b)]])
    }

    fn within(inner: &str, outer: &str) -> bool {
        covered(&[&[Shape::filter(inner)]], &[Shape::filter(outer)])
    }

    #[test]
    fn overlaps() {
        for (a, b, yes) in [
            ("events.>", "events.order", true),
            ("events.>", "*.order.>", true),
            ("events.*", "events.payment.>", false),
            ("events.*.>", "events.payment.>", true),
            ("events.*", "*.b", true),
            ("a.>", "*.b", true),
            ("a.*.>", "*.b", false),
            ("a.b", "a.b.>", false),
            (">", "x.*", true),
            (">", ">", true),
            ("a.b", "a.c", false),
        ] {
            assert_eq!(overlap(a, b), yes, "{a} & {b}");
            assert_eq!(overlap(b, a), yes, "{b} & {a}");
        }
    }

    #[test]
    fn containment() {
        for (inner, outer, yes) in [
            ("events.order", "events.>", true),
            ("events.*", "events.>", true),
            ("events.>", "events.>", true),
            ("events.>", "events.*", false),
            ("events.*.>", "events.payment.>", false),
            ("events.payment.>", "events.*.>", true),
            ("events", "events.>", false),
            ("events.a", "events.a", true),
            ("events.*", "events.a", false),
            ("a.b", ">", true),
            ("a.b.c", "a.b", false),
        ] {
            assert_eq!(within(inner, outer), yes, "{inner} within {outer}");
        }
    }

    /// Several filters together may cover what none covers alone.
    #[test]
    fn a_union_covers_what_its_parts_do_together() {
        let by = |filters: &[&str]| filters.iter().map(|f| Shape::filter(f)).collect::<Vec<_>>();
        let all = [Shape::filter("events.>")];
        assert!(covered(&[&all], &by(&["events.*", "events.*.>"])));
        assert!(!covered(&[&all], &by(&["events.*", "events.*.*.>"])));
        assert!(covered(&[&all], &by(&["events.a.>", "events.*", "events.*.>"])));
        assert!(!covered(&[&all], &by(&["events.a", "events.a.>", "events.b.>"])));
        assert!(covered(&[&all], &by(&[">"])));
        // What two streams' subjects capture between them.
        let streams = [Shape::filter("events.a.>"), Shape::filter("events.b")];
        assert!(covered(&[&all, &streams], &by(&["events.a.>", "events.b"])));
        assert!(!covered(&[&all, &streams], &by(&["events.a.>"])));
    }

    /// Fixed tokens after a placeholder still end every subject rendered.
    #[test]
    fn a_templates_shape_keeps_its_fixed_tokens() {
        let shape = |t: &str| [Shape::template(t)];
        let f = |f: &str| [Shape::filter(f)];
        assert!(!meet(&[&shape("orders.{key}.v1"), &f("orders.*.v2")]));
        assert!(meet(&[&shape("orders.{key}.v1"), &f("orders.*.v1")]));
        assert!(meet(&[&shape("orders.{key}.v1"), &f("orders.a.b.c.v1")]));
        assert!(meet(&[&shape("orders.{key}.v1"), &f("orders.>")]));
        assert!(!meet(&[&shape("orders.{key}.v1"), &f("orders.*")]));
        assert!(!covered(&[&shape("orders.{key}.v1")], &f("orders.*.v1")));
        assert!(covered(&[&shape("orders.{key}.v1")], &f("orders.>")));
        // `{type}` is two tokens at least; `{domain}` and `{id}` one.
        assert!(!meet(&[&shape("events.{type}"), &f("events.*")]));
        assert!(covered(&[&shape("events.{type}")], &f("events.*.>")));
        assert!(covered(&[&shape("events.{domain}.{id}")], &f("events.*.*")));
        assert!(!meet(&[&shape("events.{domain}"), &f("events.*.>")]));
        assert!(covered(&[&shape("events.v{key}")], &f("events.>")));
    }
}
