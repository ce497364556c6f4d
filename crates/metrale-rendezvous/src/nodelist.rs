//! Slurm host lists (`SLURM_JOB_NODELIST`): `gpu[01-04,07],login1` is
//! gpu01, gpu02, gpu03, gpu04, gpu07, login1.
//!
//! A list is items separated by commas outside brackets; an item is text
//! and bracket groups, each group a comma-separated list of numbers or
//! `lo-hi` ranges, zero-padded to the width of the number as written
//! (`01-04`). Several groups in one item multiply (`r[1-2]n[1-2]`).
//!
//! Invariants: parsing never panics; an expansion larger than
//! [`MAX_HOSTS`] is refused before anything is built; [`first_node`]
//! builds only the first host.

/// The most hosts [`expand_nodelist`] builds.
pub const MAX_HOSTS: usize = 1 << 20;

#[derive(Debug)]
enum Part<'a> {
    Text(&'a str),
    /// `(lo, hi, width)` ranges, in order.
    Set(Vec<(u64, u64, usize)>),
}

impl Part<'_> {
    fn len(&self) -> usize {
        match self {
            Part::Text(_) => 1,
            Part::Set(ranges) => ranges
                .iter()
                .map(|(lo, hi, _)| {
                    usize::try_from(hi - lo).map_or(usize::MAX, |n| n.saturating_add(1))
                })
                .fold(0usize, usize::saturating_add),
        }
    }
}

/// Splits at commas outside brackets.
fn split_top(list: &str) -> Result<Vec<&str>, String> {
    let mut items = Vec::new();
    let (mut depth, mut start) = (0usize, 0usize);
    for (i, c) in list.char_indices() {
        match c {
            '[' if depth == 0 => depth = 1,
            '[' => return Err(format!("{list:?}: nested '['")),
            ']' if depth == 1 => depth = 0,
            ']' => return Err(format!("{list:?}: ']' without '['")),
            ',' if depth == 0 => {
                items.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(format!("{list:?}: '[' without ']'"));
    }
    items.push(&list[start..]);
    Ok(items)
}

fn number(s: &str, list: &str) -> Result<u64, String> {
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{list:?}: {s:?} is not a number"));
    }
    s.parse()
        .map_err(|_| format!("{list:?}: {s:?} is too large"))
}

fn parse_item<'a>(item: &'a str, list: &str) -> Result<Vec<Part<'a>>, String> {
    if item.trim().is_empty() {
        return Err(format!("{list:?}: an empty host name"));
    }
    let mut parts = Vec::new();
    let mut rest = item;
    while let Some(open) = rest.find('[') {
        if open > 0 {
            parts.push(Part::Text(&rest[..open]));
        }
        let close = rest[open..]
            .find(']')
            .map(|c| open + c)
            .ok_or_else(|| format!("{list:?}: '[' without ']'"))?;
        let mut ranges = Vec::new();
        for r in rest[open + 1..close].split(',') {
            let (lo, hi) = r.split_once('-').unwrap_or((r, r));
            let (l, h) = (number(lo, list)?, number(hi, list)?);
            if l > h {
                return Err(format!("{list:?}: range {r:?} runs backwards"));
            }
            ranges.push((l, h, lo.len()));
        }
        parts.push(Part::Set(ranges));
        rest = &rest[close + 1..];
    }
    if !rest.is_empty() {
        parts.push(Part::Text(rest));
    }
    Ok(parts)
}

fn push_number(out: &mut String, n: u64, width: usize) {
    out.push_str(&format!("{n:0width$}"));
}

/// Every host of `list`, in order.
pub fn expand_nodelist(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top(list.trim())? {
        let parts = parse_item(item, list)?;
        let count = parts
            .iter()
            .map(Part::len)
            .try_fold(1usize, |acc, n| acc.checked_mul(n))
            .filter(|n| hosts.len().saturating_add(*n) <= MAX_HOSTS)
            .ok_or_else(|| format!("{list:?} names more than {MAX_HOSTS} hosts"))?;
        let mut names = vec![String::new()];
        for part in &parts {
            names = match part {
                Part::Text(t) => names.into_iter().map(|n| n + t).collect(),
                Part::Set(ranges) => {
                    let mut next = Vec::with_capacity(names.len() * part.len());
                    for n in &names {
                        for &(lo, hi, width) in ranges {
                            for v in lo..=hi {
                                let mut s = n.clone();
                                push_number(&mut s, v, width);
                                next.push(s);
                            }
                        }
                    }
                    next
                }
            };
        }
        debug_assert_eq!(names.len(), count);
        hosts.extend(names);
    }
    Ok(hosts)
}

/// The first host of `list` (where Slurm starts task 0).
pub fn first_node(list: &str) -> Result<String, String> {
    let items = split_top(list.trim())?;
    let first = items.first().copied().unwrap_or_default();
    let mut host = String::new();
    for part in parse_item(first, list)? {
        match part {
            Part::Text(t) => host.push_str(t),
            Part::Set(ranges) => match ranges.first() {
                Some(&(lo, _, width)) => push_number(&mut host, lo, width),
                None => return Err(format!("{list:?}: an empty '[]'")),
            },
        }
    }
    Ok(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_expand() {
        assert_eq!(
            expand_nodelist("gpu[01-04,07],login1").unwrap(),
            ["gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"]
        );
        assert_eq!(first_node("gpu[01-04,07],login1").unwrap(), "gpu01");
        assert_eq!(
            expand_nodelist("r[1-2]n[8-9]").unwrap(),
            ["r1n8", "r1n9", "r2n8", "r2n9"]
        );
        assert_eq!(expand_nodelist("a[9-11]").unwrap(), ["a9", "a10", "a11"]);
        assert_eq!(first_node("node7").unwrap(), "node7");
        assert_eq!(first_node("x[003-5]-ib").unwrap(), "x003-ib");
        for bad in [
            "", "a[", "a]", "a[1-", "a[2-1]", "a[x]", "a[[1]]", "a,,b", "a[]",
        ] {
            assert!(expand_nodelist(bad).is_err(), "{bad:?}");
        }
        assert!(expand_nodelist("a[0-99999999999]").is_err());
        assert!(expand_nodelist("a[0-18446744073709551615]").is_err());
        assert!(expand_nodelist("a[0-18446744073709551616]").is_err());
        assert_eq!(first_node("a[0-99999999999]").unwrap(), "a0");
    }

    #[test]
    fn garbage_never_panics() {
        use rand::Rng;
        let alphabet = b"ab09[],-";
        let mut rng = rand::rng();
        for _ in 0..20_000 {
            let len = rng.random_range(0..12);
            let s: String = (0..len)
                .map(|_| char::from(alphabet[rng.random_range(0..alphabet.len())]))
                .collect();
            let all = expand_nodelist(&s);
            let first = first_node(&s);
            if let (Ok(all), Ok(first)) = (&all, &first) {
                assert_eq!(all.first(), Some(first), "{s:?}");
            }
        }
    }
}
